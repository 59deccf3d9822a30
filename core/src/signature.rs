//! Signed trusted headers: the filter vouches for what it established about a request, and the
//! sidecar serves only what verifies.
//!
//! The filter signs every `x-weir-*` header it sets (tenant path, tier, weight, priority, ids,
//! estimates, limits) together with an expiry, with HMAC-SHA256 under a shared secret, and sends
//! the result as `x-weir-signature: v1:<expires_ms>:<hex>`. The sidecar recomputes the MAC over
//! the `x-weir-*` headers it received, so a header added, removed or changed on the way (or by a
//! workload that can reach the sidecar's port) fails the check. Two secrets are accepted at once
//! (current and previous), so a secret can be rotated without downtime: roll the sidecars to
//! accept the new one, then the filters to sign with it, then drop the old one.
//!
//! The canonical message is `v1\n<expires_ms>\n` followed by `name:value\n` for each signed
//! header, names lowercase and sorted, so header order on the wire does not matter.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::trusted;

const VERSION: &str = "v1";

/// Secrets shorter than this are refused by both sides' configuration.
pub const MIN_SECRET_BYTES: usize = 32;

/// Words that mark a value as one to replace (the shipped Secret's is such a placeholder).
const PLACEHOLDER_MARKS: [&str; 4] = ["replace-me", "replace_me", "change-me", "changeme"];

/// Fewer distinct bytes than this in a secret are a pattern (`0000…`, `abab…`), not random:
/// 32 random bytes, hex or base64, have over 14.
const MIN_DISTINCT_BYTES: usize = 8;

/// Whether `value` is marked as one to replace (`REPLACE-ME…`, `changeme`): a value shipped in
/// an example, public, that whoever deploys it was to put their own in place of.
pub fn is_placeholder(value: &[u8]) -> bool {
    let lower = value.to_ascii_lowercase();
    PLACEHOLDER_MARKS
        .iter()
        .any(|m| lower.windows(m.len()).any(|w| w == m.as_bytes()))
}

/// Why a signing secret is refused: too short, a placeholder, or a pattern. Whoever knows the
/// secret can claim any tenant to a sidecar, so one that is public (written in a shipped file)
/// or guessable is as bad as none; both sides refuse it when they start.
pub fn check_secret(secret: &[u8]) -> Result<(), &'static str> {
    if secret.len() < MIN_SECRET_BYTES {
        return Err("is shorter than 32 bytes");
    }
    if is_placeholder(secret) {
        return Err("is a placeholder: draw a secret, e.g. `openssl rand -hex 32`");
    }
    let mut seen = [false; 256];
    for &b in secret {
        seen[usize::from(b)] = true;
    }
    if seen.iter().filter(|&&s| s).count() < MIN_DISTINCT_BYTES {
        return Err("is a pattern, not random: draw a secret, e.g. `openssl rand -hex 32`");
    }
    Ok(())
}

/// Why a signature did not verify.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("the request carries no signature")]
    Missing,
    #[error("the signature is malformed")]
    Malformed,
    #[error("the signature has expired")]
    Expired,
    #[error("the signature does not match the signed headers")]
    Mismatch,
    #[error("a signed header appears more than once")]
    DuplicateHeader,
}

/// The canonical message for `headers` (signature header excluded), or a duplicate name.
fn message(headers: &[(&str, &str)], expires_ms: u64) -> Result<Vec<u8>, SignatureError> {
    let mut signed: Vec<(String, &str)> = headers
        .iter()
        .filter(|(name, _)| trusted::is_reserved(name) && !is_signature(name))
        .map(|(name, value)| (name.to_ascii_lowercase(), *value))
        .collect();
    signed.sort_unstable();
    if signed.windows(2).any(|w| w[0].0 == w[1].0) {
        return Err(SignatureError::DuplicateHeader);
    }
    let mut out = format!("{VERSION}\n{expires_ms}\n").into_bytes();
    for (name, value) in signed {
        out.extend_from_slice(name.as_bytes());
        out.push(b':');
        out.extend_from_slice(value.as_bytes());
        out.push(b'\n');
    }
    Ok(out)
}

fn is_signature(name: &str) -> bool {
    name.eq_ignore_ascii_case(trusted::SIGNATURE)
}

fn mac(secret: &[u8], message: &[u8]) -> Hmac<Sha256> {
    // HMAC takes keys of any length; `new_from_slice` cannot fail for it.
    let mut mac = match <Hmac<Sha256> as KeyInit>::new_from_slice(secret) {
        Ok(mac) => mac,
        Err(_) => <Hmac<Sha256> as KeyInit>::new(&Default::default()),
    };
    mac.update(message);
    mac
}

/// The value of `x-weir-signature` for the `x-weir-*` headers among `headers` (others are
/// ignored), valid until `expires_ms` (Unix milliseconds).
pub fn sign(
    secret: &[u8],
    headers: &[(&str, &str)],
    expires_ms: u64,
) -> Result<String, SignatureError> {
    let tag = mac(secret, &message(headers, expires_ms)?)
        .finalize()
        .into_bytes();
    let hex: String = tag.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("{VERSION}:{expires_ms}:{hex}"))
}

/// Checks the signature among `headers` against every `x-weir-*` header present, under any of
/// `secrets`, at `now_ms`. Comparison is constant-time.
pub fn verify(
    secrets: &[&[u8]],
    headers: &[(&str, &str)],
    now_ms: u64,
) -> Result<(), SignatureError> {
    let mut values = headers.iter().filter(|(name, _)| is_signature(name));
    let value = values.next().ok_or(SignatureError::Missing)?.1;
    if values.next().is_some() {
        return Err(SignatureError::DuplicateHeader);
    }
    let mut parts = value.splitn(3, ':');
    let (Some(VERSION), Some(expires), Some(hex)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(SignatureError::Malformed);
    };
    let expires_ms: u64 = expires.parse().map_err(|_| SignatureError::Malformed)?;
    let tag = decode_hex(hex).ok_or(SignatureError::Malformed)?;
    if tag.len() != 32 {
        return Err(SignatureError::Malformed);
    }
    let message = message(headers, expires_ms)?;
    let valid = secrets
        .iter()
        .any(|secret| mac(secret, &message).verify_slice(&tag).is_ok());
    if !valid {
        return Err(SignatureError::Mismatch);
    }
    if now_ms > expires_ms {
        return Err(SignatureError::Expired);
    }
    Ok(())
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";
    const OLD: &[u8] = b"fedcba9876543210fedcba9876543210";

    #[test]
    fn short_placeholder_and_patterned_secrets_are_refused() {
        assert_eq!(check_secret(SECRET), Ok(()));
        assert_eq!(
            check_secret(b"3f9a1c0e5b7d2846a1f03c9e8b5d7a2604e1c9b3f7a5d28e6c0b4a9f1e3d5c7b"),
            Ok(())
        );
        assert!(check_secret(b"short").is_err());
        for placeholder in [
            &b"REPLACE-ME-with-32-or-more-random-bytes-0123456789abcdef"[..],
            b"please-change-me-to-something-random-1234567890",
            b"changeme-changeme-changeme-changeme",
        ] {
            let error = check_secret(placeholder).unwrap_err();
            assert!(error.contains("placeholder"), "{error}");
        }
        assert!(check_secret(&[b'0'; 64]).unwrap_err().contains("pattern"));
        assert!(check_secret(&b"ab".repeat(20)).is_err());
    }

    fn headers() -> Vec<(&'static str, &'static str)> {
        vec![
            ("x-weir-tenant", "acme/w/p/k"),
            ("x-weir-weight", "2"),
            ("content-type", "application/json"),
            ("x-weir-request-id", "weir-1"),
        ]
    }

    fn signed(secret: &[u8], expires: u64) -> Vec<(&'static str, String)> {
        let h = headers();
        let sig = sign(secret, &h, expires).unwrap();
        let mut out: Vec<(&str, String)> = h.into_iter().map(|(k, v)| (k, v.to_owned())).collect();
        out.push((trusted::SIGNATURE, sig));
        out
    }

    fn check(h: &[(&str, String)], secrets: &[&[u8]], now: u64) -> Result<(), SignatureError> {
        let view: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
        verify(secrets, &view, now)
    }

    #[test]
    fn a_signed_request_verifies_under_either_secret() {
        let h = signed(SECRET, 1_000);
        assert_eq!(check(&h, &[SECRET], 999), Ok(()));
        assert_eq!(check(&h, &[OLD, SECRET], 1_000), Ok(()), "rotation");
        assert_eq!(check(&h, &[OLD], 0), Err(SignatureError::Mismatch));
        assert_eq!(check(&h, &[SECRET], 1_001), Err(SignatureError::Expired));
    }

    #[test]
    fn order_of_headers_does_not_matter_but_every_weir_header_is_covered() {
        let mut h = signed(SECRET, 1_000);
        h.reverse();
        assert_eq!(check(&h, &[SECRET], 0), Ok(()));
        // Headers outside the namespace are not signed (Envoy adds its own).
        h.push(("x-forwarded-for", "10.0.0.1".into()));
        assert_eq!(check(&h, &[SECRET], 0), Ok(()));

        let mut changed = signed(SECRET, 1_000);
        changed[1].1 = "1e300".into();
        assert_eq!(check(&changed, &[SECRET], 0), Err(SignatureError::Mismatch));

        let mut added = signed(SECRET, 1_000);
        added.push(("X-Weir-Priority", "interactive".into()));
        assert_eq!(check(&added, &[SECRET], 0), Err(SignatureError::Mismatch));

        let mut removed = signed(SECRET, 1_000);
        removed.remove(0);
        assert_eq!(check(&removed, &[SECRET], 0), Err(SignatureError::Mismatch));

        let mut doubled = signed(SECRET, 1_000);
        doubled.push(("x-weir-tenant", "globex/w/p/k".into()));
        assert_eq!(
            check(&doubled, &[SECRET], 0),
            Err(SignatureError::DuplicateHeader)
        );
    }

    #[test]
    fn the_expiry_is_signed_too() {
        let mut h = signed(SECRET, 1_000);
        let last = h.len() - 1;
        h[last].1 = h[last].1.replacen("1000", "9999", 1);
        assert_eq!(check(&h, &[SECRET], 0), Err(SignatureError::Mismatch));
    }

    #[test]
    fn malformed_and_missing_signatures_are_named() {
        let h: Vec<(&str, String)> = headers().into_iter().map(|(k, v)| (k, v.into())).collect();
        assert_eq!(check(&h, &[SECRET], 0), Err(SignatureError::Missing));
        for bad in [
            "", "v1", "v1:x:00", "v2:1:00", "v1:1:zz", "v1:1:abc", "v1:1:00",
        ] {
            let mut b = h.clone();
            b.push((trusted::SIGNATURE, bad.into()));
            assert_eq!(
                check(&b, &[SECRET], 0),
                Err(SignatureError::Malformed),
                "{bad:?}"
            );
        }
        let mut twice = signed(SECRET, 1_000);
        twice.push((trusted::SIGNATURE, twice[twice.len() - 1].1.clone()));
        assert_eq!(
            check(&twice, &[SECRET], 0),
            Err(SignatureError::DuplicateHeader)
        );
    }
}
