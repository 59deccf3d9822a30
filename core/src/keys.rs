//! API keys are stored as the SHA-256 of the key, never in plain text.
//!
//! Keys are long random strings, so a fast hash is enough: there is nothing to brute-force.

use sha2::{Digest, Sha256};

/// Prefix of keys minted by `weir keys new`, so leaked keys are recognisable.
pub const KEY_PREFIX: &str = "wk-";

/// Lowercase hex SHA-256 of a key: what the config stores and lookups use.
pub fn hash_key(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    let mut hex = String::with_capacity(64);
    for byte in digest {
        hex.push(char::from(HEX[usize::from(byte >> 4)]));
        hex.push(char::from(HEX[usize::from(byte & 0xf)]));
    }
    hex
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// The API key of a request: `Authorization: Bearer <key>` or `x-api-key: <key>`.
pub fn key_from_headers<'a>(
    authorization: Option<&'a str>,
    x_api_key: Option<&'a str>,
) -> Option<&'a str> {
    let bearer = authorization.and_then(|v| {
        let (scheme, token) = v.trim().split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
    });
    bearer
        .or(x_api_key.map(str::trim))
        .filter(|k| !k.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_sha256_hex() {
        assert_eq!(
            hash_key("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn bearer_wins_over_x_api_key() {
        assert_eq!(key_from_headers(Some("Bearer k1"), Some("k2")), Some("k1"));
        assert_eq!(key_from_headers(Some("bearer  k1 "), None), Some("k1"));
        assert_eq!(key_from_headers(None, Some("k2")), Some("k2"));
        assert_eq!(key_from_headers(Some("Basic abc"), Some("k2")), Some("k2"));
        assert_eq!(key_from_headers(Some("Bearer "), None), None);
        assert_eq!(key_from_headers(None, None), None);
    }
}
