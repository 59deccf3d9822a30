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
use sha2::{Digest, Sha256};
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
    /// The price table the filter charges at (`x-weir-price`): the ledger records the
    /// request's cost at its model's entry.
    pub prices: Option<weir_core::price::Prices>,
    /// The route and the mode the filter served the request in (absent from filters older
    /// than these headers): the ledger records them.
    pub route: Option<String>,
    pub mode: Option<String>,
    /// The run the call belongs to and the agent that made it, when the request named a run
    /// (the filter vouches the caller's ids): the ledger records them, and an approval is
    /// bound to the run.
    pub run_id: Option<String>,
    pub agent: Option<String>,
    /// The tool patterns whose calls wait for an approver (`x-weir-tool-approval`).
    pub tool_approval: Vec<String>,
    /// The terms those calls wait under (the approvals store's defaults when not vouched).
    pub approval_terms: Option<weir_core::config::ApprovalTerms>,
    /// On weir's approvals API: the tenant subtrees the key approves for (`x-weir-approves`).
    pub approves: Vec<String>,
}

/// `x-weir-*` headers as (name, value).
type Headers<'h> = Vec<(&'h str, &'h str)>;

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
        let (weir, expires_ms) = self.verified(headers, now_ms)?;
        let who = parse(&weir)?;
        self.once(&who.request_id, expires_ms, now_ms)?;
        Ok(who)
    }

    /// A signed call that vouches for its body (a quota lease call): the signature is checked
    /// here, from the headers alone, before the body is read; the body is then checked against
    /// the digest it covers ([`Trust::accept`]). Each signature serves once, by the call's
    /// `x-weir-request-id` if it has one, else by the signature itself.
    pub fn check_call(&self, headers: &HeaderMap, now_ms: u64) -> Result<SignedBody, ApiError> {
        let (weir, expires_ms) = self.verified(headers, now_ms)?;
        let get = |name: &str| weir.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
        let digest = get(trusted::BODY_SHA256)
            .filter(|d| d.len() == 64 && d.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
            .ok_or_else(|| {
                untrusted_call("the call does not sign its body's digest (x-weir-body-sha256)")
            })?
            .to_owned();
        let once = match get(trusted::REQUEST_ID) {
            Some(id) if trusted::is_id(id) => format!("call:{id}"),
            Some(_) => return Err(invalid(trusted::REQUEST_ID, "is not a valid id")),
            None => format!("signature:{}", get(trusted::SIGNATURE).unwrap_or_default()),
        };
        Ok(SignedBody {
            digest,
            once,
            expires_ms,
        })
    }

    /// Accepts `body` for a checked call if it is the body that was signed, once: a body that
    /// does not match spends nothing, so a racer sending the captured headers with another
    /// body cannot make the genuine call look like a replay.
    pub fn accept(&self, signed: &SignedBody, body: &[u8], now_ms: u64) -> Result<(), ApiError> {
        let digest: String = Sha256::digest(body)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        if digest != signed.digest {
            return Err(untrusted_call(
                "the body does not match its signed digest (x-weir-body-sha256)",
            ));
        }
        self.once(&signed.once, signed.expires_ms, now_ms)
    }

    /// The `x-weir-*` headers, once their signature verifies, and the signature's expiry.
    fn verified<'h>(
        &self,
        headers: &'h HeaderMap,
        now_ms: u64,
    ) -> Result<(Headers<'h>, u64), ApiError> {
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
        Ok((weir, expires_ms))
    }

    /// Refuses a signature already served (`id` names it) while it is valid.
    fn once(&self, id: &str, expires_ms: u64, now_ms: u64) -> Result<(), ApiError> {
        let fresh = self
            .used
            .lock()
            .map(|mut used| used.insert(id, expires_ms, now_ms))
            .unwrap_or(false);
        if fresh {
            return Ok(());
        }
        Err(ApiError::new(
            401,
            "this signed request was already served: a captured request cannot be replayed",
        )
        .with_code("replayed_request"))
    }
}

/// A call whose signature verified: the body digest it signed, and what marks it used.
#[derive(Debug)]
pub struct SignedBody {
    digest: String,
    once: String,
    expires_ms: u64,
}

fn untrusted_call(problem: &str) -> ApiError {
    ApiError::new(
        401,
        format!("calls must come from the weir filter: {problem}"),
    )
    .with_code("untrusted_request")
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
    let optional = |name: &'static str, ok: fn(&str) -> bool, problem: &str| match get(name) {
        Some(value) if ok(value) => Ok(Some(value.to_owned())),
        Some(_) => Err(invalid(name, problem)),
        None => Ok(None),
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
    let idempotency_key = optional(
        trusted::IDEMPOTENCY_KEY,
        trusted::is_id,
        "is not a valid key",
    )?;
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
        prices: get(trusted::PRICE)
            .map(|v| {
                weir_core::price::Prices::parse_header(v)
                    .ok_or_else(|| invalid(trusted::PRICE, "is not a price table"))
            })
            .transpose()?,
        route: optional(trusted::ROUTE, trusted::is_id, "is not a route name")?,
        mode: optional(
            trusted::MODE,
            |m| trusted::MODES.contains(&m),
            "is not a mode",
        )?,
        run_id: optional(trusted::RUN_ID, is_run_name, "is not a run id")?,
        agent: optional(trusted::AGENT, is_run_name, "is not an agent name")?,
        tool_approval: list(get(trusted::TOOL_APPROVAL), trusted::TOOL_APPROVAL, |p| {
            weir_core::config::malformed_tool_pattern(p).is_none()
        })?,
        approval_terms: get(trusted::APPROVAL_TERMS)
            .map(|v| {
                weir_core::config::ApprovalTerms::parse_header(v)
                    .ok_or_else(|| invalid(trusted::APPROVAL_TERMS, "is not approval terms"))
            })
            .transpose()?,
        approves: list(
            get(trusted::APPROVES),
            trusted::APPROVES,
            trusted::is_tenant_path,
        )?,
    })
}

/// A run id or agent name as a run is keyed by ([`weir_core::run::RunKey`]): 1 to
/// [`weir_core::run::identity::MAX_ID_LEN`] visible ASCII characters.
fn is_run_name(name: &str) -> bool {
    trusted::is_id(name) && name.len() <= weir_core::run::identity::MAX_ID_LEN
}

/// A comma-separated list of values each `ok`, or empty when the header is absent (the tool
/// approval patterns, the approver scopes).
fn list(
    value: Option<&str>,
    name: &'static str,
    ok: fn(&str) -> bool,
) -> Result<Vec<String>, ApiError> {
    let Some(value) = value else {
        return Ok(Vec::new());
    };
    let items: Vec<String> = value.split(',').map(str::to_owned).collect();
    if items.iter().all(|i| ok(i)) {
        Ok(items)
    } else {
        Err(invalid(
            name,
            "is not a comma-separated list of valid entries",
        ))
    }
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
        assert_eq!(who.prices, None, "no prices: the record is not priced");
        assert_eq!((who.route, who.mode), (None, None), "an older filter's");
        assert_eq!((who.run_id, who.agent), (None, None), "no run named");
        assert_eq!((who.tool_approval.len(), who.approves.len()), (0, 0));
        let mut run = base();
        run[4].1 = "weir-run".into();
        run.push((trusted::RUN_ID, "run-7/step:a".into()));
        run.push((trusted::AGENT, "planner".into()));
        run.push((trusted::TOOL_APPROVAL, "deploy_*,send_email".into()));
        run.push((trusted::APPROVAL_TERMS, "5000,3,1".into()));
        run.push((trusted::APPROVES, "acme,acme/lab".into()));
        let who = trust().check(&signed(SECRET, &run, 2_000), 1_000).unwrap();
        assert_eq!(
            (who.run_id.as_deref(), who.agent.as_deref()),
            (Some("run-7/step:a"), Some("planner"))
        );
        assert_eq!(who.tool_approval, ["deploy_*", "send_email"]);
        let terms = who.approval_terms.unwrap();
        assert_eq!(
            (terms.ttl_ms, terms.max_pending, terms.self_approve),
            (5000, 3, true)
        );
        assert_eq!(who.approves, ["acme", "acme/lab"]);
        let mut routed = base();
        routed[4].1 = "weir-routed".into();
        routed.push((trusted::ROUTE, "llm-api".into()));
        routed.push((trusted::MODE, "shadow".into()));
        let who = trust()
            .check(&signed(SECRET, &routed, 2_000), 1_000)
            .unwrap();
        assert_eq!(
            (who.route.as_deref(), who.mode.as_deref()),
            (Some("llm-api"), Some("shadow"))
        );
        let mut priced = base();
        priced[4].1 = "weir-priced".into();
        priced.push((trusted::PRICE, "USD:*=1,1,2;m=0.15,0.075,0.6".into()));
        let who = trust()
            .check(&signed(SECRET, &priced, 2_000), 1_000)
            .unwrap();
        let prices = who.prices.expect("a price table");
        assert_eq!(prices.of("m").map(|p| p.output), Some(0.6));
        assert_eq!(prices.of("other").map(|p| p.output), Some(2.0));
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
        let long_run = "r".repeat(weir_core::run::identity::MAX_ID_LEN + 1);
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
            (trusted::PRICE, "USD:m=-1,1,1"),
            (trusted::PRICE, "USD:m=0.15,0.6"),
            (trusted::PRICE, "USD:0.15,0.075,0.6"),
            (trusted::MODE, "ignore"),
            (trusted::ROUTE, "llm api"),
            (trusted::RUN_ID, "run 1"),
            (trusted::RUN_ID, ""),
            (trusted::AGENT, "plan ner"),
            (trusted::RUN_ID, long_run.as_str()),
            (trusted::TOOL_APPROVAL, "deploy_*,,x"),
            (trusted::TOOL_APPROVAL, "rm -rf"),
            (trusted::APPROVAL_TERMS, "0,3,0"),
            (trusted::APPROVAL_TERMS, "5000,3,yes"),
            (trusted::APPROVAL_TERMS, "5000,3"),
            (trusted::APPROVES, "acme,../x"),
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

    #[test]
    fn a_call_is_trusted_for_the_body_it_signed_once() {
        let t = trust();
        let body = br#"{"counters":[]}"#;
        let digest: String = Sha256::digest(body)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let call = |id: &str| {
            let mut fields = vec![(trusted::BODY_SHA256, digest.clone())];
            if !id.is_empty() {
                fields.push((trusted::REQUEST_ID, id.to_owned()));
            }
            signed(SECRET, &fields, 2_000)
        };
        let status = |r: Result<SignedBody, ApiError>| {
            r.and_then(|s| t.accept(&s, body, 1_000))
                .map_err(|e| e.code)
        };
        // Another body under the captured headers is refused and spends nothing...
        let signed_body = t.check_call(&call("lease-1"), 1_000).unwrap();
        let other = t.accept(&signed_body, br#"{"counters":[{}]}"#, 1_000).err();
        assert_eq!(other.map(|e| e.code), Some(Some("untrusted_request")));
        // ...so the genuine call is still served, once per id; without one, once per signature.
        assert_eq!(status(t.check_call(&call("lease-1"), 1_000)), Ok(()));
        let replayed = Err(Some("replayed_request"));
        assert_eq!(status(t.check_call(&call("lease-1"), 1_000)), replayed);
        assert_eq!(status(t.check_call(&call(""), 1_000)), Ok(()));
        assert_eq!(status(t.check_call(&call(""), 1_000)), replayed);
        // A forwarded request's signature vouches for no body.
        let no_digest = signed(SECRET, &base(), 2_000);
        let e = Err(Some("untrusted_request"));
        assert_eq!(status(t.check_call(&no_digest, 1_000)), e);
        let mut bad = signed(SECRET, &[(trusted::BODY_SHA256, "ABC".into())], 2_000);
        assert_eq!(status(t.check_call(&bad, 1_000)), e);
        bad.remove(trusted::SIGNATURE);
        assert_eq!(status(t.check_call(&bad, 1_000)), e);
    }
}
