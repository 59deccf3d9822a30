//! Which API a request path names, decided on one canonical spelling so that no spelling an
//! engine decodes to a metered route slips past as something else.
//!
//! Engines route on the decoded path: `/v1/chat%2Fcompletions`, `//v1/chat/completions`,
//! `/v1/x/../chat/completions` and (on case-insensitive servers) `/V1/Chat/Completions/` all
//! reach the chat endpoint. [`canonical`] folds every such spelling into one: query dropped,
//! percent-escapes decoded once (as the engine does), `\` read as `/`, empty and `.` segments
//! dropped, `..` resolved, ASCII lowercased.
//!
//! [`classify`] then answers in order, so the allow-list can never un-meter an inference API:
//! metered ([`Api::Metered`]), an inference API weir does not meter yet ([`Api::NotMetered`]),
//! weir's own API ([`Api::Weir`]: authenticated, served by the sidecar, never metered),
//! allowed without metering ([`Api::Allowed`]), or unknown. The API part of a path starts at its
//! first segment that begins a known or allowed path (`/shadow/v1/models` is `/v1/models`
//! mounted under `/shadow`); everything from there must match exactly, so
//! `/v1/chat/completions/v1/models` is unknown rather than allowed.

use serde::Deserialize;

use crate::endpoint::Endpoint;
use crate::error::ApiError;

/// What a path is to the front door.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// An API weir meters.
    Metered(Endpoint),
    /// An inference API engines serve that weir cannot meter yet; names the API.
    NotMetered(&'static str),
    /// weir's own API ([`WEIR_API`]), taking these methods.
    Weir(&'static str),
    /// On the allow-list: served without metering (model list, health).
    Allowed,
    /// Anything else.
    Unknown,
}

/// A path that cannot be decoded (bad escape, not UTF-8, control characters).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the request path cannot be decoded: {0}")]
pub struct PathError(&'static str);

/// Paths allowed on enforced routes when the config names none.
pub const DEFAULT_ALLOWED: [&str; 2] = ["/v1/models", "/health"];

/// weir's approvals API: `GET` the list (`?state=pending`), `GET` one (`/{id}`), `POST`
/// `/{id}/approve` or `/{id}/reject`. The sidecar serves it to the keys the filter vouches an
/// approver's scopes for.
pub const WEIR_API: &str = "/v1/weir/approvals";

const METERED: [(&str, Endpoint); 5] = [
    ("/v1/chat/completions", Endpoint::ChatCompletions),
    ("/v1/completions", Endpoint::Completions),
    ("/v1/responses", Endpoint::Responses),
    ("/v1/messages", Endpoint::Messages),
    ("/v1/embeddings", Endpoint::Embeddings),
];

/// Inference APIs of vLLM, SGLang, TGI and hosted APIs: a path equal to one of these, or under
/// one ending in `/`, is refused as not metered rather than as unknown. Under the metered APIs:
/// stored responses (`/v1/responses/{id}`, its cancel and input items: one namespace per engine,
/// not per tenant) and Anthropic's token counting.
const NOT_METERED: [(&str, &str); 19] = [
    ("/v1/responses/", "stored Responses"),
    ("/v1/messages/", "Anthropic Messages token counting"),
    ("/invocations", "SageMaker invocations"),
    ("/v1/audio/", "Audio"),
    ("/v1/images/", "Images"),
    ("/v1/realtime", "Realtime"),
    ("/v1/moderations", "Moderations"),
    ("/tokenize", "Tokenize"),
    ("/detokenize", "Detokenize"),
    ("/pooling", "Pooling"),
    ("/classify", "Classify"),
    ("/score", "Score"),
    ("/v1/score", "Score"),
    ("/rerank", "Rerank"),
    ("/v1/rerank", "Rerank"),
    ("/v2/rerank", "Rerank"),
    ("/generate", "Generate"),
    ("/generate_stream", "Generate"),
    ("/inference/v1/generate", "Generate"),
];

/// The canonical form of a request path (see the module doc); the query string is dropped.
pub fn canonical(raw: &str) -> Result<String, PathError> {
    let path = raw.split(['?', '#']).next().unwrap_or_default();
    let decoded = percent_decode(path)?;
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split(['/', '\\']) {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut out = String::with_capacity(decoded.len() + 1);
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    if out.is_empty() {
        out.push('/');
    }
    Ok(out.to_ascii_lowercase())
}

fn percent_decode(s: &str) -> Result<String, PathError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or(PathError("malformed percent-escape"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b);
            i += 1;
        }
    }
    if out.iter().any(u8::is_ascii_control) {
        return Err(PathError("control character"));
    }
    String::from_utf8(out).map_err(|_| PathError("not UTF-8"))
}

/// Classifies a canonical path against the metered APIs, the known unmetered ones and
/// `allowed` (canonical paths).
pub fn classify(canonical: &str, allowed: &[String]) -> Api {
    let known = METERED
        .iter()
        .map(|(p, _)| *p)
        .chain(NOT_METERED.iter().map(|(p, _)| *p))
        .chain(allowed.iter().map(String::as_str));
    let roots: Vec<&str> = known.filter_map(first_segment).collect();
    // The API part starts at the first segment that can begin one.
    let api = segment_starts(canonical)
        .find(|&at| first_segment(&canonical[at..]).is_some_and(|s| roots.contains(&s)))
        .map_or(canonical, |at| &canonical[at..]);

    if let Some((_, endpoint)) = METERED.iter().find(|(p, _)| *p == api) {
        return Api::Metered(*endpoint);
    }
    let not_metered = NOT_METERED.iter().find(|(p, _)| match p.strip_suffix('/') {
        Some(dir) => api.starts_with(p) || api == dir,
        None => api == *p,
    });
    if let Some((_, name)) = not_metered {
        return Api::NotMetered(name);
    }
    if let Some(methods) = weir_api(api) {
        return Api::Weir(methods);
    }
    if allowed.iter().any(|p| p == api) {
        return Api::Allowed;
    }
    Api::Unknown
}

/// The methods a path of weir's API takes: the list, one approval, a decision on one. Nothing
/// deeper, and no empty id.
fn weir_api(api: &str) -> Option<&'static str> {
    let rest = api.strip_prefix(WEIR_API)?;
    if rest.is_empty() {
        return Some("GET");
    }
    let mut segments = rest.strip_prefix('/')?.split('/');
    match (segments.next(), segments.next(), segments.next()) {
        (Some(_), None, None) => Some("GET"),
        (Some(_), Some("approve" | "reject"), None) => Some("POST"),
        _ => None,
    }
}

/// Byte offsets of every `/` that starts a segment.
fn segment_starts(path: &str) -> impl Iterator<Item = usize> + '_ {
    path.match_indices('/').map(|(i, _)| i)
}

fn first_segment(path: &str) -> Option<&str> {
    path.strip_prefix('/')?.split('/').next()
}

/// Where the front door sends a request it lets through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// Admit the body and meter the answer.
    Metered(Endpoint),
    /// On the allow-list: forward without metering.
    Unmetered,
    /// weir's own API: forward to the sidecar, authenticated, without metering.
    Weir,
}

/// A request refused for its path or method, with the metric label of why.
#[derive(Clone, Debug, PartialEq)]
pub struct Refusal {
    pub error: ApiError,
    pub reason: &'static str,
    /// For 405: the methods the path takes (the `Allow` header).
    pub allow: Option<&'static str>,
}

fn refuse(reason: &'static str, error: ApiError) -> Refusal {
    Refusal {
        error: error.with_code(reason),
        reason,
        allow: None,
    }
}

/// Decides on a request's path and method, deny by default: metered APIs take `POST`, allowed
/// paths `GET` and `HEAD`; inference APIs weir does not meter yet, unknown and undecodable
/// paths are refused.
pub fn route(raw_path: &str, method: &str, allowed: &AllowedPaths) -> Result<Route, Refusal> {
    let path = canonical(raw_path)
        .map_err(|e| refuse("invalid_path", ApiError::bad_request(e.to_string())))?;
    let (route, methods) = match classify(&path, allowed.as_slice()) {
        Api::Metered(endpoint) => (Route::Metered(endpoint), "POST"),
        Api::Allowed => (Route::Unmetered, "GET, HEAD"),
        Api::Weir(methods) => (Route::Weir, methods),
        Api::NotMetered(name) => {
            return Err(refuse(
                "not_metered",
                ApiError::not_found(format!(
                    "The {name} API ({path}) is not metered by this gateway, so it is not \
                     served here; it meters {}.",
                    metered_paths()
                )),
            ));
        }
        Api::Unknown => {
            return Err(refuse(
                "unknown_path",
                ApiError::not_found(format!(
                    "Unknown path {path}: this gateway meters {}, and serves {} without metering.",
                    metered_paths(),
                    allowed.as_slice().join(", ")
                )),
            ));
        }
    };
    if !methods.split(", ").any(|m| m == method) {
        let error = ApiError::new(
            405,
            format!("{method} is not allowed on {path}; use {methods}."),
        );
        return Err(Refusal {
            allow: Some(methods),
            ..refuse("method_not_allowed", error)
        });
    }
    Ok(route)
}

fn metered_paths() -> String {
    METERED.map(|(p, _)| p).join(", ")
}

/// Whether a configured allow-list entry is already canonical (so it can match at all).
pub fn is_canonical(path: &str) -> bool {
    path.starts_with('/') && canonical(path).is_ok_and(|c| c == path)
}

/// Paths served unmetered on enforced routes (`allowed_paths` in the config), each in
/// canonical spelling; defaults to [`DEFAULT_ALLOWED`].
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(try_from = "Vec<String>")]
pub struct AllowedPaths(Vec<String>);

impl AllowedPaths {
    pub fn as_slice(&self) -> &[String] {
        &self.0
    }
}

impl Default for AllowedPaths {
    fn default() -> Self {
        AllowedPaths(DEFAULT_ALLOWED.iter().map(|p| (*p).to_owned()).collect())
    }
}

impl TryFrom<Vec<String>> for AllowedPaths {
    type Error = String;

    fn try_from(paths: Vec<String>) -> Result<Self, String> {
        match paths.iter().find(|p| !is_canonical(p)) {
            Some(p) => Err(format!(
                "'{p}' is not a canonical path: write it lowercase, starting with '/', without \
                 a query, a trailing slash, '.', '..' or percent-escapes (as '{}')",
                canonical(p).unwrap_or_default()
            )),
            None => Ok(AllowedPaths(paths)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(raw: &str) -> Api {
        let allowed = AllowedPaths::default();
        canonical(raw).map_or(Api::Unknown, |c| classify(&c, allowed.as_slice()))
    }

    #[test]
    fn every_spelling_of_chat_is_chat() {
        for raw in [
            "/v1/chat/completions",
            "/v1/chat/completions/",
            "/v1/chat/completions?stream=true",
            "//v1//chat///completions",
            "/v1/chat%2Fcompletions",
            "/v1/chat%2fcompletions",
            "/v1/%63hat/completions",
            "/v1/models/../chat/completions",
            "/v1/./chat/./completions",
            "/v1/chat/completions/.",
            "/../v1/chat/completions",
            "/V1/CHAT/COMPLETIONS",
            "/v1\\chat\\completions",
            "/v1%5Cchat%5Ccompletions",
            "/shadow/v1/chat/completions",
            "/team/a/v1/chat/completions",
        ] {
            assert_eq!(api(raw), Api::Metered(Endpoint::ChatCompletions), "{raw}");
        }
        assert_eq!(api("/v1/completions"), Api::Metered(Endpoint::Completions));
        assert_eq!(api("//v1/Responses/"), Api::Metered(Endpoint::Responses));
        assert_eq!(
            api("/shadow/v1/messages?beta=true"),
            Api::Metered(Endpoint::Messages)
        );
        assert_eq!(api("/v1/embeddings"), Api::Metered(Endpoint::Embeddings));
    }

    #[test]
    fn inference_apis_weir_cannot_meter_are_named() {
        for (raw, name) in [
            ("/v1/responses/resp_1", "stored Responses"),
            ("/v1/responses/resp_1/cancel", "stored Responses"),
            (
                "/v1/messages/count_tokens",
                "Anthropic Messages token counting",
            ),
            ("/INVOCATIONS", "SageMaker invocations"),
            ("/v1/audio/transcriptions", "Audio"),
            ("/tokenize", "Tokenize"),
            ("/pooling", "Pooling"),
            ("/score", "Score"),
            ("/v1/rerank", "Rerank"),
            ("/x/rerank/", "Rerank"),
        ] {
            assert_eq!(api(raw), Api::NotMetered(name), "{raw}");
        }
    }

    #[test]
    fn only_the_allow_list_passes_unmetered() {
        assert_eq!(api("/v1/models"), Api::Allowed);
        assert_eq!(api("/v1/models/"), Api::Allowed);
        assert_eq!(api("/shadow/health"), Api::Allowed);
        for raw in [
            "/",
            "/metrics",
            "/v1",
            "/v1/models/x",
            "/v1/chat",
            "/v1/chat/completions/v1/models",
            "/invocations/health",
            "/v1/chat/completions;x=1",
            "/v1/chat/completions%3Fx",
            "/api/chat",
        ] {
            assert_eq!(api(raw), Api::Unknown, "{raw}");
        }
    }

    #[test]
    fn the_allow_list_never_unmeters_an_inference_api() {
        let wide = vec![
            "/v1/chat/completions".to_owned(),
            "/v1/embeddings".to_owned(),
            "/v1/responses/resp_1".to_owned(),
        ];
        assert_eq!(
            classify("/v1/chat/completions", &wide),
            Api::Metered(Endpoint::ChatCompletions)
        );
        assert_eq!(
            classify("/v1/embeddings", &wide),
            Api::Metered(Endpoint::Embeddings)
        );
        assert_eq!(
            classify("/v1/responses/resp_1", &wide),
            Api::NotMetered("stored Responses")
        );
    }

    #[test]
    fn weir_s_approvals_api_is_its_own_class_with_its_methods() {
        assert_eq!(api("/v1/weir/approvals?state=pending"), Api::Weir("GET"));
        assert_eq!(api("/v1/weir/approvals/apr_x"), Api::Weir("GET"));
        assert_eq!(api("//V1/weir/approvals/apr_x/Approve/"), Api::Weir("POST"));
        assert_eq!(api("/v1/weir/approvals/apr_x/reject"), Api::Weir("POST"));
        for raw in [
            "/v1/weir",
            "/v1/weir/approvalsx",
            "/v1/weir/approvals/apr_x/delete",
            "/v1/weir/approvals/apr_x/approve/more",
            "/v1/weir/approvals/../../chat/completions/x",
        ] {
            assert_eq!(api(raw), Api::Unknown, "{raw}");
        }
        // Never a way around metering.
        assert_eq!(
            api("/v1/weir/approvals/../../chat/completions"),
            Api::Metered(Endpoint::ChatCompletions)
        );
        let allowed = AllowedPaths::default();
        assert_eq!(
            route("/v1/weir/approvals/apr_x/approve", "POST", &allowed),
            Ok(Route::Weir)
        );
        let get = route("/v1/weir/approvals/apr_x/approve", "GET", &allowed).err();
        assert_eq!(get.and_then(|r| r.allow), Some("POST"));
        let post = route("/v1/weir/approvals", "POST", &allowed).err();
        assert_eq!(post.and_then(|r| r.allow), Some("GET"));
    }

    #[test]
    fn undecodable_paths_are_errors() {
        assert!(canonical("/v1/chat%2").is_err());
        assert!(canonical("/v1/chat%zzcompletions").is_err());
        assert!(canonical("/v1/%ff").is_err());
        assert!(canonical("/v1/%00chat").is_err());
        assert!(canonical("/v1/%0a").is_err());
    }

    #[test]
    fn canonical_forms() {
        assert_eq!(canonical("").ok().as_deref(), Some("/"));
        assert_eq!(canonical("/a/../../b/").ok().as_deref(), Some("/b"));
        assert_eq!(canonical("/A%20B").ok().as_deref(), Some("/a b"));
        assert!(is_canonical("/v1/models"));
        assert!(!is_canonical("/v1/models/"));
        assert!(!is_canonical("v1/models"));
        assert!(!is_canonical("/V1/Models"));
    }

    #[test]
    fn allow_lists_must_be_canonical() {
        let parse = |json: &str| serde_json::from_str::<AllowedPaths>(json);
        assert!(parse(r#"["/v1/models", "/ping"]"#).is_ok());
        let err = parse(r#"["/V1/Models/"]"#).err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("(as '/v1/models')")));
        assert!(parse(r#"["v1/models"]"#).is_err());
    }

    #[test]
    fn routes_take_their_methods_and_refusals_say_why() {
        let allowed = AllowedPaths::default();
        let chat = Route::Metered(Endpoint::ChatCompletions);
        assert_eq!(route("//v1/chat/completions/", "POST", &allowed), Ok(chat));
        assert_eq!(route("/v1/models", "HEAD", &allowed), Ok(Route::Unmetered));

        let refusal = |path: &str, method: &str| route(path, method, &allowed).err();
        let get = refusal("/v1/chat/completions", "GET");
        assert!(get.as_ref().is_some_and(|r| r.error.status == 405
            && r.reason == "method_not_allowed"
            && r.allow == Some("POST")));
        assert_eq!(
            refusal("/v1/models", "POST").and_then(|r| r.allow),
            Some("GET, HEAD")
        );
        let stored = refusal("/v1/responses/resp_1", "GET");
        assert!(stored.is_some_and(|r| r.error.status == 404
            && r.error.code == Some("not_metered")
            && r.error.message.contains("stored Responses API")));
        let unknown = refusal("/v1/nope", "GET");
        assert!(unknown.is_some_and(|r| r.error.code == Some("unknown_path")
            && r.error.message.contains("/v1/models, /health")));
        let invalid = refusal("/v1/%zz", "POST");
        assert!(invalid.is_some_and(|r| r.error.status == 400 && r.reason == "invalid_path"));
    }
}
