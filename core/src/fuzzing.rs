//! The invariants weir's parsers keep on any input, as functions the fuzz targets in `fuzz/`
//! run under libFuzzer and the corpus replay below runs as an ordinary test, so the two never
//! drift apart. Every check panics on a violated invariant (that is how libFuzzer and the test
//! harness learn of it); weir's own code must never panic on any input.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)] // checks report by panicking

use crate::admission::{self, Rejection};
use crate::config::Config;
use crate::endpoint::Endpoint;
use crate::estimate::Counting;
use crate::meter::{BodyMeter, MAX_HELD_BYTES, MAX_KEPT_BYTES, StreamMeter};
use crate::prediction::OutputHistory;
use crate::request::InferenceRequest;
use crate::signature;

/// The SSE and JSON meters: never panic; with the usage event asked for, forward exactly the
/// bytes given; otherwise forward them minus whole events only (a subsequence); give the same
/// answer however the stream is cut into chunks; never hold more than their bound.
///
/// Every API's meter reads the same input.
///
/// Input: one byte of flags (bit 0: hide the usage event; the rest: chunk size), then the stream.
pub fn check_meter(data: &[u8]) {
    let Some((&flags, stream)) = data.split_first() else {
        return;
    };
    let hide = flags & 1 == 1;
    let chunk = usize::from(flags >> 1) + 1;
    for endpoint in Endpoint::ALL {
        check_meter_of(endpoint, hide, chunk, stream);
    }
}

fn check_meter_of(endpoint: Endpoint, hide: bool, chunk: usize, stream: &[u8]) {
    let mut whole = StreamMeter::new(endpoint, hide);
    let all_at_once = whole.feed(stream, true);
    let mut cut = StreamMeter::new(endpoint, hide);
    // Metering alone (what a relay forwarding every byte does) reads the stream the same way.
    let mut metered = StreamMeter::new(endpoint, hide);
    let mut forwarded = Vec::new();
    let mut pieces = stream.chunks(chunk).peekable();
    while let Some(piece) = pieces.next() {
        let last = pieces.peek().is_none();
        forwarded.extend(cut.feed(piece, last));
        metered.meter(piece, last);
        let held = cut.held_bytes().max(metered.held_bytes());
        assert!(held <= MAX_HELD_BYTES + MAX_KEPT_BYTES, "held {held}");
    }
    if stream.is_empty() {
        forwarded.extend(cut.feed(&[], true));
        metered.meter(&[], true);
    }
    assert_eq!(metered.usage(), cut.usage());
    assert_eq!(metered.generated_tokens(), cut.generated_tokens());
    assert_eq!(metered.error_events(), cut.error_events());
    assert_eq!(metered.saw_done(), cut.saw_done());
    if hide {
        assert!(is_subsequence(&forwarded, stream), "bytes were invented");
    } else {
        assert_eq!(
            forwarded, stream,
            "a stream asked for usage passes untouched"
        );
    }
    if stream.len() <= MAX_HELD_BYTES {
        assert_eq!(forwarded, all_at_once, "chunking changed the output");
        assert_eq!(cut.usage(), whole.usage());
        assert_eq!(cut.generated_tokens(), whole.generated_tokens());
    }
    assert!(whole.generated_tokens() <= stream.len() as u64);

    let mut body = BodyMeter::new(endpoint, MAX_HELD_BYTES);
    body.feed(stream);
    let _ = body.finish();
}

fn is_subsequence(needle: &[u8], haystack: &[u8]) -> bool {
    let mut rest = haystack.iter();
    needle.iter().all(|b| rest.any(|h| h == b))
}

/// A configuration for [`check_admit`]: limits at two levels, a capped model and an uncapped
/// one, a default `max_tokens`, and a small body limit.
const ADMIT_CONFIG: &str = r#"{
    "orgs": [{"id": "o", "limits": {"max_output_tokens": 4000}, "workspaces": [{"id": "w",
        "projects": [{"id": "p", "policy": {"default_max_tokens": 64}, "keys": [
            {"id": "k", "sha256": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
             "limits": {"max_context_tokens": 3000}}]}]}]}],
    "models": {"small": {"max_context_tokens": 2048}},
    "estimator": {"exact_below_bytes": 512},
    "max_body_bytes": 65536
}"#;

/// Admission over an arbitrary body: never panics; what it admits has consistent numbers (the
/// output reservation within the caps, prompt plus output within the context, a rewritten body
/// that is JSON and admits again to the same numbers, usage always asked of the engine for
/// streams); what it refuses, it refuses with a 4xx.
///
/// Input: one byte choosing the endpoint, then the body.
pub fn check_admit(data: &[u8]) {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    let endpoint = Endpoint::ALL[usize::from(which) % Endpoint::ALL.len()];
    let config = Config::parse(ADMIT_CONFIG.as_bytes()).expect("the check's config is valid");
    let directory = config.directory();
    let tenant = directory.lookup(&"a".repeat(64)).expect("the check's key");
    let admit = |body: &[u8], counting| {
        admission::admit(&config, tenant, endpoint, body, counting, |_| {
            OutputHistory::default()
        })
    };
    let (exact, estimated) = (
        admit(body, Counting::Exact),
        admit(body, Counting::Estimated),
    );
    if body.len() <= config.estimator.exact_below_bytes {
        // Whatever text the estimate is wrong about, it decides nothing exact counting would
        // decide otherwise.
        assert_eq!(
            exact.as_ref().err().map(|r| r.reason),
            estimated.as_ref().err().map(|r| r.reason),
            "the estimate decided otherwise"
        );
    }
    for (counting, admitted) in [(Counting::Exact, exact), (Counting::Estimated, estimated)] {
        check_admitted(admit, endpoint, body, counting, admitted);
    }
}

/// The invariants of one admission of `body` (see [`check_admit`]).
fn check_admitted(
    admit: impl Fn(&[u8], Counting) -> Result<admission::Admitted, Rejection>,
    endpoint: Endpoint,
    body: &[u8],
    counting: Counting,
    admitted: Result<admission::Admitted, Rejection>,
) {
    match admitted {
        Err(Rejection { error, reason }) => {
            assert!(
                (400..500).contains(&error.status),
                "{reason}: status {}",
                error.status
            );
        }
        Ok(a) => {
            let req = InferenceRequest::parse(endpoint, body).expect("an admitted body parses");
            let answers = req.answers();
            let cap = if a.model == "small" { 2048 } else { 3000 };
            match a.reserved_output.checked_div(answers) {
                None => assert_eq!(a.reserved_output, 0, "embeddings generate nothing"),
                Some(per_answer) => {
                    assert_eq!(per_answer * answers, a.reserved_output);
                    assert!(per_answer >= 1);
                    assert!(per_answer <= 4000, "over the output cap");
                    assert!(per_answer <= cap, "over the context");
                }
            }
            if answers == 1 {
                assert!(
                    a.prompt_tokens + a.reserved_output <= cap,
                    "over the context"
                );
            }
            assert!(
                a.prompt_tokens <= 4 * body.len() as u64 + 8,
                "estimate out of bounds"
            );
            let sent = a.rewritten_body.clone().unwrap_or_else(|| body.to_vec());
            let value: serde_json::Value = serde_json::from_slice(&sent).expect("sent JSON");
            if a.stream && req.usage_is_optional() {
                assert_eq!(
                    value["stream_options"]["include_usage"], true,
                    "usage forced"
                );
            }
            let again = admit(&sent, counting).expect("what was sent upstream admits again");
            assert_eq!(again.prompt_tokens, a.prompt_tokens);
            if a.predicted {
                // The key's cap filled in is a limit the second reading reserves in full.
                assert!(again.reserved_output >= a.reserved_output);
            } else {
                assert_eq!(again.reserved_output, a.reserved_output);
            }
        }
    }
}

/// The configuration parser: never panics; what it accepts holds together.
pub fn check_config(data: &[u8]) {
    let Ok(config) = Config::parse(data) else {
        return;
    };
    assert!(config.max_body_bytes > 0);
    assert!(config.slot_lease_ms >= 1_000);
    let directory = config.directory();
    for tenant in directory.tenants() {
        assert!(!tenant.levels.is_empty());
        assert_eq!(tenant.weights.len(), tenant.path().split('/').count());
        assert!(
            tenant.weights.iter().all(|w| w.is_finite() && *w > 0.0),
            "{:?}",
            tenant.weights
        );
    }
    assert!(config.route(Some("any")).rollout_percent <= 100);
}

const SECRET: &[u8] = b"fuzzing-secret-fuzzing-secret-0123456789";
const OTHER: &[u8] = b"another-secret-another-secret-0123456789";

/// The trusted-header verifier: never accepts headers it did not sign (the fuzzer does not know
/// the secret); accepts what was signed until it expires; refuses any change to a signed header.
///
/// Input: eight bytes of clock, then header lines `name:value`.
pub fn check_verify(data: &[u8]) {
    let (now, rest) = data.split_at(data.len().min(8));
    let mut clock = [0u8; 8];
    clock[..now.len()].copy_from_slice(now);
    let now_ms = u64::from_le_bytes(clock) >> 1;
    let text = String::from_utf8_lossy(rest);
    let headers: Vec<(&str, &str)> = text.lines().filter_map(|l| l.split_once(':')).collect();
    assert!(
        signature::verify(&[SECRET], &headers, now_ms).is_err(),
        "accepted a signature made without the secret"
    );
    assert!(signature::verify(&[], &headers, now_ms).is_err());

    let unsigned: Vec<(&str, &str)> = headers
        .iter()
        .copied()
        .filter(|(n, _)| !n.eq_ignore_ascii_case(crate::trusted::SIGNATURE))
        .collect();
    let expires = now_ms.saturating_add(1);
    let Ok(tag) = signature::sign(SECRET, &unsigned, expires) else {
        return;
    };
    let mut signed = unsigned.clone();
    signed.push((crate::trusted::SIGNATURE, &tag));
    assert_eq!(signature::verify(&[OTHER, SECRET], &signed, now_ms), Ok(()));
    assert!(signature::verify(&[OTHER], &signed, now_ms).is_err());
    if expires < u64::MAX {
        assert!(signature::verify(&[SECRET], &signed, expires + 1).is_err());
    }
    if let Some(i) = signed.iter().position(|(n, _)| {
        crate::trusted::is_reserved(n) && !n.eq_ignore_ascii_case(crate::trusted::SIGNATURE)
    }) {
        let changed = format!("{}x", signed[i].1);
        let mut tampered = signed.clone();
        tampered[i].1 = &changed;
        assert!(
            signature::verify(&[SECRET], &tampered, now_ms).is_err(),
            "tampering accepted"
        );
    }
}

/// Every committed corpus file, replayed through its target's check on every `cargo test`.
#[cfg(all(test, not(target_family = "wasm")))]
mod corpus {
    use std::path::Path;

    fn replay(target: &str, check: fn(&[u8])) {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fuzz/corpus")
            .join(target);
        let mut files = 0;
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            check(&std::fs::read(&path).unwrap());
            files += 1;
        }
        assert!(files > 0, "{} is empty", dir.display());
    }

    #[test]
    fn meter_corpus() {
        replay("meter", super::check_meter);
    }

    #[test]
    fn admit_corpus() {
        replay("admit", super::check_admit);
    }

    #[test]
    fn config_corpus() {
        replay("config", super::check_config);
    }

    #[test]
    fn verify_corpus() {
        replay("verify", super::check_verify);
    }
}
