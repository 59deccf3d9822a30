//! Failure injection for reliability tests of whatever sits in front of the simulator: faults
//! of the whole process, chosen on the command line ([`FaultFlags`]), and faults of one answer's
//! shape, asked for by the request itself ([`RequestFaults`], header `x-sim-fault`) so that one
//! simulator serves a test's tricky answers and its plain ones side by side.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};

/// Faults chosen on the command line; all off by default.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct FaultFlags {
    /// Fraction of requests answered at once with 500 InternalServerError.
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    pub error_rate: f64,
    /// Fraction of requests answered at once with 429 and `Retry-After: 1`.
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    pub throttle_rate: f64,
    /// Cut every response's connection (no `[DONE]`, no usage) after this many tokens.
    #[arg(long, value_name = "TOKENS")]
    pub drop_after: Option<u32>,
    /// Pause every stream for `--stall-for` after this many tokens.
    #[arg(long, value_name = "TOKENS", requires = "stall_for")]
    pub stall_after: Option<u32>,
    /// How long a stall lasts, in wall-clock milliseconds.
    #[arg(long, value_name = "MS", value_parser = parse_millis)]
    pub stall_for: Option<Duration>,
    /// Crash (exit code 70) as soon as the N-th request has produced its first token,
    /// taking every in-flight stream down with it.
    #[arg(long, value_name = "N")]
    pub exit_after: Option<u64>,
    /// Start hung: accept every new inference request and never answer it (no status line,
    /// no bytes) until the client goes away; `/health` and `/metrics` keep answering.
    /// Switch at run time with `PUT /debug/faults/hang`.
    #[arg(long)]
    pub hang: bool,
}

/// The header a request names its own faults in, comma-separated.
pub const FAULT_HEADER: &str = "x-sim-fault";

/// Faults of one answer's shape.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestFaults {
    /// `split-tool-name`: each streamed tool call's name arrives over two deltas where the shape
    /// streams names (chat; Responses and Messages carry it whole when the item or block
    /// opens), and the stream's first arguments fragment over two events in every shape — the
    /// cases a filter that inspects tool calls must reassemble.
    pub split_tool_name: bool,
}

impl RequestFaults {
    /// The faults a request's headers ask for; an unknown one is refused, so that a typo does
    /// not quietly test the plain answer.
    pub fn of_headers(headers: &axum::http::HeaderMap) -> Result<Self, String> {
        let mut faults = RequestFaults::default();
        for value in headers.get_all(FAULT_HEADER) {
            let value = value
                .to_str()
                .map_err(|_| format!("{FAULT_HEADER}: not text"))?;
            for fault in value.split(',').map(str::trim).filter(|f| !f.is_empty()) {
                match fault {
                    "split-tool-name" => faults.split_tool_name = true,
                    other => return Err(format!("{FAULT_HEADER}: unknown fault `{other}`")),
                }
            }
        }
        Ok(faults)
    }
}

fn parse_millis(s: &str) -> Result<Duration, String> {
    s.parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|e| format!("expected milliseconds: {e}"))
}

/// What to do with an incoming request before it reaches the engine.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Serve,
    Fail,
    Throttle,
}

pub struct Faults {
    pub flags: FaultFlags,
    rng: Mutex<SmallRng>,
    accepted: AtomicU64,
    hang: AtomicBool,
    /// Requests held unanswered by the hang right now.
    hung: AtomicU64,
}

/// A request held by the hang; released when the client goes away and the handler is dropped.
pub struct Held<'a>(&'a AtomicU64);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Faults {
    pub fn new(flags: FaultFlags, seed: u64) -> Self {
        Faults {
            hang: AtomicBool::new(flags.hang),
            flags,
            rng: Mutex::new(SmallRng::seed_from_u64(seed)),
            accepted: AtomicU64::new(0),
            hung: AtomicU64::new(0),
        }
    }

    /// Turns the hang on or off for requests arriving from now on.
    pub fn set_hang(&self, on: bool) {
        self.hang.store(on, Ordering::Relaxed);
    }

    pub fn hangs(&self) -> bool {
        self.hang.load(Ordering::Relaxed)
    }

    /// Counts a request as held by the hang for as long as the guard lives.
    pub fn hold(&self) -> Held<'_> {
        self.hung.fetch_add(1, Ordering::Relaxed);
        Held(&self.hung)
    }

    pub fn num_hung(&self) -> u64 {
        self.hung.load(Ordering::Relaxed)
    }

    /// Draws this request's fate and, when it is served, its 1-based acceptance number.
    pub fn admit(&self) -> (Verdict, u64) {
        let roll: f64 = match self.rng.lock() {
            Ok(mut rng) => rng.random(),
            Err(poisoned) => poisoned.into_inner().random(),
        };
        if roll < self.flags.error_rate {
            return (Verdict::Fail, 0);
        }
        if roll < self.flags.error_rate + self.flags.throttle_rate {
            return (Verdict::Throttle, 0);
        }
        (
            Verdict::Serve,
            self.accepted.fetch_add(1, Ordering::Relaxed) + 1,
        )
    }

    /// Whether the request with this acceptance number brings the process down.
    pub fn is_fatal(&self, accepted: u64) -> bool {
        self.flags.exit_after.is_some_and(|n| accepted >= n)
    }

    /// A stall to insert before token `index`, if any.
    pub fn stall_before(&self, index: u32) -> Option<Duration> {
        match (self.flags.stall_after, self.flags.stall_for) {
            (Some(n), Some(d)) if index == n => Some(d),
            _ => None,
        }
    }

    pub fn drops_before(&self, index: u32) -> bool {
        self.flags.drop_after.is_some_and(|n| index >= n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_split_requests() {
        let flags = FaultFlags {
            error_rate: 0.2,
            throttle_rate: 0.3,
            ..FaultFlags::default()
        };
        let faults = Faults::new(flags, 3);
        let verdicts: Vec<Verdict> = (0..2000).map(|_| faults.admit().0).collect();
        let count = |v: Verdict| verdicts.iter().filter(|&x| *x == v).count();
        assert!((300..500).contains(&count(Verdict::Fail)));
        assert!((500..700).contains(&count(Verdict::Throttle)));
        assert!((900..1100).contains(&count(Verdict::Serve)));
    }

    #[test]
    fn no_faults_by_default() {
        let faults = Faults::new(FaultFlags::default(), 0);
        assert_eq!(faults.admit(), (Verdict::Serve, 1));
        assert_eq!(faults.admit(), (Verdict::Serve, 2));
        assert!(!faults.is_fatal(1_000_000));
        assert!(faults.stall_before(0).is_none());
        assert!(!faults.drops_before(1_000_000));
        assert!(!faults.hangs());
    }

    #[test]
    fn request_faults_are_read_from_the_header_and_unknown_ones_refused() {
        let mut headers = axum::http::HeaderMap::new();
        assert_eq!(
            RequestFaults::of_headers(&headers),
            Ok(RequestFaults::default())
        );
        headers.insert(FAULT_HEADER, " split-tool-name ,".parse().unwrap());
        assert!(RequestFaults::of_headers(&headers).unwrap().split_tool_name);
        headers.insert(FAULT_HEADER, "split-tool-nam".parse().unwrap());
        assert!(RequestFaults::of_headers(&headers).is_err());
    }

    #[test]
    fn hang_switches_and_counts_held_requests() {
        let faults = Faults::new(FaultFlags::default(), 0);
        faults.set_hang(true);
        assert!(faults.hangs());
        let held = faults.hold();
        assert_eq!(faults.num_hung(), 1);
        drop(held);
        assert_eq!(faults.num_hung(), 0);
        faults.set_hang(false);
        assert!(!faults.hangs());
    }
}
