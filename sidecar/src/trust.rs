//! What the sidecar believes about a request: only what the filter signed.
//!
//! Every `x-weir-*` header must be covered by a valid, unexpired `x-weir-signature` under the
//! current or the previous secret (rotation), each signature serves one request (a captured
//! request replayed while its signature is still valid is refused), and every signed value is
//! parsed strictly: a value out of range is refused, never replaced by a default. Unsigned,
//! forged, expired and replayed requests get an OpenAI-shaped 401; a signed but malformed value
//! (a filter bug or a version skew) a 400 naming the header.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use axum::http::HeaderMap;
use weir_core::config::Priority;
use weir_core::error::ApiError;
use weir_core::signature::{self, SignatureError};
use weir_core::trusted;

/// What the filter established about a request.
#[derive(Clone, Debug, PartialEq)]
pub struct Trusted {
    pub tenant: String,
    /// weir's id for this attempt, unique per forward.
    pub request_id: String,
    /// The caller's `Idempotency-Key`, if it sent one.
    pub idempotency_key: Option<String>,
    pub tier: String,
    /// The scheduling weight of each level of the tenant path, org first.
    pub weights: Vec<f64>,
    pub priority: Priority,
    pub kv_cap: Option<u64>,
    /// The models the key may use, when it may not use all.
    pub models: Option<Vec<String>>,
}

/// The verifier: the accepted secrets and the signatures already used.
pub struct Trust {
    secrets: Vec<Vec<u8>>,
    used: Mutex<UsedSignatures>,
}

impl Trust {
    pub fn new(secrets: Vec<Vec<u8>>) -> Trust {
        Trust {
            secrets,
            used: Mutex::new(UsedSignatures::default()),
        }
    }

    /// The trusted facts of a request, or the reply that refuses it.
    pub fn check(&self, headers: &HeaderMap, now_ms: u64) -> Result<Trusted, ApiError> {
        let mut weir = Vec::new();
        for (name, value) in headers {
            if trusted::is_reserved(name.as_str()) {
                let value = value
                    .to_str()
                    .map_err(|_| invalid(name.as_str(), "is not visible ASCII"))?;
                weir.push((name.as_str(), value));
            }
        }
        let secrets: Vec<&[u8]> = self.secrets.iter().map(Vec::as_slice).collect();
        signature::verify(&secrets, &weir, now_ms).map_err(untrusted)?;
        let expires_ms = weir
            .iter()
            .find(|(n, _)| *n == trusted::SIGNATURE)
            .and_then(|(_, v)| v.split(':').nth(1)?.parse().ok())
            .unwrap_or(now_ms);
        let who = parse(&weir)?;
        let fresh = self
            .used
            .lock()
            .map(|mut used| used.insert(&who.request_id, expires_ms, now_ms))
            .unwrap_or(false);
        if !fresh {
            return Err(ApiError::new(
                401,
                "AuthenticationError",
                "this signed request was already served: a captured request cannot be replayed",
            )
            .with_code("replayed_request"));
        }
        Ok(who)
    }
}

/// Request ids of signatures still valid, so each serves once. Entries leave when their
/// signature expires (a replay after that fails the expiry check instead).
#[derive(Default)]
struct UsedSignatures {
    ids: HashMap<String, u64>,
    by_age: VecDeque<(u64, String)>,
}

impl UsedSignatures {
    /// Records `id` until `expires_ms`; false if it is already there.
    fn insert(&mut self, id: &str, expires_ms: u64, now_ms: u64) -> bool {
        while let Some((expires, _)) = self.by_age.front() {
            if *expires >= now_ms {
                break;
            }
            if let Some((_, old)) = self.by_age.pop_front()
                && self.ids.get(&old).is_some_and(|e| *e < now_ms)
            {
                self.ids.remove(&old);
            }
        }
        if self.ids.contains_key(id) {
            return false;
        }
        self.ids.insert(id.to_owned(), expires_ms);
        self.by_age.push_back((expires_ms, id.to_owned()));
        true
    }
}

fn untrusted(e: SignatureError) -> ApiError {
    let code = match e {
        SignatureError::Expired => "signature_expired",
        _ => "untrusted_request",
    };
    ApiError::new(
        401,
        "AuthenticationError",
        format!("requests must come through the weir filter: {e}"),
    )
    .with_code(code)
}

fn invalid(header: &str, problem: &str) -> ApiError {
    ApiError::bad_request(format!("trusted header {header} {problem}"))
        .with_code("invalid_trusted_header")
}

/// Parses the signed values strictly.
fn parse(headers: &[(&str, &str)]) -> Result<Trusted, ApiError> {
    let get = |name: &str| headers.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
    let required = |name: &'static str| get(name).ok_or_else(|| invalid(name, "is missing"));
    let checked = |name: &'static str, ok: fn(&str) -> bool, problem: &str| {
        let value = required(name)?;
        if ok(value) {
            Ok(value.to_owned())
        } else {
            Err(invalid(name, problem))
        }
    };
    let tokens = |name: &'static str| -> Result<Option<u64>, ApiError> {
        get(name)
            .map(|v| {
                trusted::parse_tokens(v).ok_or_else(|| invalid(name, "is not a bounded integer"))
            })
            .transpose()
    };
    let priority = match required(trusted::PRIORITY)? {
        "interactive" => Priority::Interactive,
        "batch" => Priority::Batch,
        _ => return Err(invalid(trusted::PRIORITY, "is not a known priority")),
    };
    let idempotency_key = match get(trusted::IDEMPOTENCY_KEY) {
        Some(key) if trusted::is_id(key) => Some(key.to_owned()),
        Some(_) => return Err(invalid(trusted::IDEMPOTENCY_KEY, "is not a valid key")),
        None => None,
    };
    let tenant = checked(
        trusted::TENANT,
        trusted::is_tenant_path,
        "is not a tenant path",
    )?;
    let weights = trusted::parse_weights(required(trusted::WEIGHT)?, tenant.split('/').count())
        .ok_or_else(|| {
            invalid(
                trusted::WEIGHT,
                "is not one finite weight in range per level of the tenant path",
            )
        })?;
    Ok(Trusted {
        tenant,
        request_id: checked(trusted::REQUEST_ID, trusted::is_id, "is not a valid id")?,
        idempotency_key,
        tier: checked(trusted::TIER, trusted::is_level_id, "is not a tier name")?,
        weights,
        priority,
        kv_cap: tokens(trusted::KV_LIMIT)?,
        models: get(trusted::MODELS)
            .map(|v| {
                trusted::parse_models(v)
                    .ok_or_else(|| invalid(trusted::MODELS, "is not a model list"))
            })
            .transpose()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{HeaderName, HeaderValue};

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";
    const OLD: &[u8] = b"fedcba9876543210fedcba9876543210";

    fn base() -> Vec<(&'static str, String)> {
        vec![
            (trusted::TENANT, "acme/lab/e2e/k".into()),
            (trusted::TIER, "standard".into()),
            (trusted::WEIGHT, "1,1,1,2".into()),
            (trusted::PRIORITY, "batch".into()),
            (trusted::REQUEST_ID, "weir-1".into()),
            (trusted::KV_LIMIT, "5000".into()),
        ]
    }

    fn signed(secret: &[u8], fields: &[(&'static str, String)], expires: u64) -> HeaderMap {
        let view: Vec<(&str, &str)> = fields.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let sig = signature::sign(secret, &view, expires).unwrap();
        let mut h = HeaderMap::new();
        for (k, v) in fields.iter().chain([&(trusted::SIGNATURE, sig)]) {
            h.insert(
                HeaderName::from_static(k),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    fn trust() -> Trust {
        Trust::new(vec![SECRET.to_vec(), OLD.to_vec()])
    }

    fn code(r: Result<Trusted, ApiError>) -> (u16, String) {
        let e = r.unwrap_err();
        let j = e.to_json();
        (
            e.status,
            j["error"]["code"].as_str().unwrap_or("").to_owned(),
        )
    }

    #[test]
    fn signed_values_are_trusted() {
        let who = trust()
            .check(&signed(SECRET, &base(), 2_000), 1_000)
            .unwrap();
        assert_eq!(
            (
                who.tenant.as_str(),
                who.weights.as_slice(),
                who.priority,
                who.kv_cap
            ),
            (
                "acme/lab/e2e/k",
                [1.0, 1.0, 1.0, 2.0].as_slice(),
                Priority::Batch,
                Some(5000)
            )
        );
        // The previous secret still verifies (rotation).
        let mut other = base();
        other[4].1 = "weir-2".into();
        assert!(trust().check(&signed(OLD, &other, 2_000), 1_000).is_ok());
    }

    #[test]
    fn unsigned_forged_expired_and_replayed_requests_are_401() {
        let t = trust();
        let mut unsigned = HeaderMap::new();
        unsigned.insert(trusted::TENANT, HeaderValue::from_static("acme/lab/e2e/k"));
        assert_eq!(
            code(t.check(&unsigned, 0)),
            (401, "untrusted_request".into())
        );

        let mut forged = signed(SECRET, &base(), 2_000);
        forged.insert(trusted::WEIGHT, HeaderValue::from_static("1e300"));
        assert_eq!(code(t.check(&forged, 0)), (401, "untrusted_request".into()));

        let stranger = signed(b"an attacker's guess at the secret!", &base(), 2_000);
        assert_eq!(
            code(t.check(&stranger, 0)),
            (401, "untrusted_request".into())
        );

        let h = signed(SECRET, &base(), 2_000);
        assert_eq!(code(t.check(&h, 2_001)), (401, "signature_expired".into()));
        assert!(t.check(&h, 1_000).is_ok());
        assert_eq!(code(t.check(&h, 1_001)), (401, "replayed_request".into()));
    }

    #[test]
    fn bad_signed_values_are_refused_never_defaulted() {
        for (name, bad) in [
            (trusted::WEIGHT, "1,1,1,NaN"),
            (trusted::WEIGHT, "1e300,1,1,1"),
            (trusted::WEIGHT, "1,inf,1,1"),
            // One weight per level (or an older filter's one), never more levels.
            (trusted::WEIGHT, "1,1,1,1,1"),
            (trusted::WEIGHT, "1,1"),
            (trusted::PRIORITY, "urgent"),
            (trusted::KV_LIMIT, "-1"),
            (trusted::KV_LIMIT, "99999999999999999999"),
            (trusted::TENANT, "../../etc"),
            (trusted::TENANT, "a/b/c/d/e"),
            (trusted::TIER, "gold tier"),
            (trusted::MODELS, "a,,b"),
            (trusted::IDEMPOTENCY_KEY, ""),
        ] {
            let mut fields = base();
            fields.retain(|(n, _)| *n != name);
            fields.push((name, bad.into()));
            assert_eq!(
                code(trust().check(&signed(SECRET, &fields, 2_000), 0)),
                (400, "invalid_trusted_header".into()),
                "{name}: {bad}"
            );
        }
        let mut missing = base();
        missing.retain(|(n, _)| *n != trusted::WEIGHT);
        assert_eq!(
            code(trust().check(&signed(SECRET, &missing, 2_000), 0)).0,
            400
        );
    }

    #[test]
    fn used_signatures_are_forgotten_once_expired() {
        let mut used = UsedSignatures::default();
        assert!(used.insert("a", 100, 0));
        assert!(!used.insert("a", 100, 50));
        assert!(used.insert("b", 300, 200), "a expired and left");
        assert_eq!(used.ids.len(), 1);
    }
}
