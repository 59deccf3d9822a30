//! The exchange's transitions, driven natively: a [`Mock`] host holds shared data in memory
//! and records what the exchange did to the request (headers set, local replies, calls sent,
//! metrics), so each test can say what a wrong transition would have done differently.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use proxy_wasm::types::{Action, Status};
use serde_json::{Value, json};
use weir_core::config::{Config, Tenant};
use weir_core::fleet::{Grant, LeaseRequest, LeaseResponse};
use weir_core::keys::hash_key;
use weir_core::reply::Reply;
use weir_core::reservation::{self, Denial, Ledger, LimitKind};
use weir_core::store::{SharedStore, StoreError};

use super::admit::depends_on_input;
use super::headers::rollout_bucket;
use super::respond::is_identity;
use super::{Exchange, Headers, Host, Side};
use crate::Gateway;
use crate::host::Metrics;
use crate::telemetry;

const KEY: &str = "sk-weir-test-0123456789";
const NOW: u64 = 1_000_000;
const LEASE_MS: u64 = 1_000;

/// Shared data as Envoy keeps it: compare-and-swap on a version per key.
#[derive(Default)]
struct Memory(RefCell<HashMap<String, (Vec<u8>, u32)>>);

impl SharedStore for Memory {
    fn load(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.0.borrow().get(key).cloned()
    }

    fn store(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let mut data = self.0.borrow_mut();
        let current = data.get(key).map(|(_, c)| *c);
        // An absent key is written whatever the token, as Envoy does.
        if current.is_some() && cas.is_some() && cas != current {
            return Err(StoreError::CasMismatch);
        }
        data.insert(key.to_owned(), (value.to_vec(), current.unwrap_or(0) + 1));
        Ok(())
    }
}

type Pairs = Vec<(String, String)>;

/// A host in memory: what Envoy would hand the exchange, and a record of what it did.
#[derive(Default)]
struct Mock {
    store: Memory,
    now: Cell<u64>,
    ids: Cell<u64>,
    route_name: Option<String>,
    request_headers: RefCell<Pairs>,
    response_headers: RefCell<Pairs>,
    request_body: RefCell<Vec<u8>>,
    response_body: RefCell<Vec<u8>>,
    reply: RefCell<Option<(u16, Pairs, Vec<u8>)>>,
    /// Replies held back (`hold_reply`): the test host sends them at once, as `reply`.
    held_replies: Cell<usize>,
    resumed: Cell<usize>,
    /// Calls sent: cluster, headers, body.
    calls: RefCell<Vec<(String, Pairs, Vec<u8>)>>,
    call_answer: RefCell<(Option<u16>, Vec<u8>)>,
    metrics: RefCell<HashMap<String, i64>>,
    filter_state: RefCell<HashMap<String, String>>,
}

fn pairs(headers: &[(&str, &str)]) -> Pairs {
    headers
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn set(headers: &RefCell<Pairs>, name: &str, value: Option<&str>) {
    let mut headers = headers.borrow_mut();
    headers.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
    if let Some(value) = value {
        headers.push((name.to_owned(), value.to_owned()));
    }
}

impl Host for Mock {
    type Store = Memory;

    fn store(&self) -> &Memory {
        &self.store
    }

    fn now_ms(&self) -> u64 {
        self.now.get()
    }

    fn random_u64(&self) -> u64 {
        self.ids.set(self.ids.get() + 1);
        self.ids.get()
    }

    fn unique_id(&self) -> String {
        format!("weir-{}", self.random_u64())
    }

    fn property(&self, path: &[&str]) -> Option<String> {
        (path == ["xds", "route_name"])
            .then(|| self.route_name.clone())
            .flatten()
    }

    fn headers(&self, side: Side) -> Headers {
        Headers::new(self.side_headers(side).borrow().clone())
    }

    fn set_header(&self, side: Side, name: &str, value: Option<&str>) {
        set(self.side_headers(side), name, value);
    }

    fn body(&self, side: Side, size: usize) -> Vec<u8> {
        let body = self.side_body(side).borrow();
        body[..size.min(body.len())].to_vec()
    }

    fn replace_body(&self, side: Side, _: usize, value: &[u8]) {
        *self.side_body(side).borrow_mut() = value.to_vec();
    }

    fn local_reply(&self, status: u16, headers: &[(&str, String)], body: &[u8]) {
        let headers = headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect();
        *self.reply.borrow_mut() = Some((status, headers, body.to_vec()));
    }

    fn hold_reply(&self, reply: Reply) {
        self.held_replies.set(self.held_replies.get() + 1);
        self.local_reply(reply.status, &reply.headers, &reply.body);
    }

    fn resume_request(&self) {
        self.resumed.set(self.resumed.get() + 1);
    }

    fn dispatch(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        _: u64,
    ) -> Result<u32, Status> {
        let mut calls = self.calls.borrow_mut();
        calls.push((cluster.to_owned(), pairs(headers), body.to_vec()));
        Ok(calls.len() as u32)
    }

    fn call_response(&self, body_size: usize) -> (Option<u16>, Vec<u8>) {
        let (status, body) = self.call_answer.borrow().clone();
        (status, body[..body_size.min(body.len())].to_vec())
    }

    fn add(&self, metric: &str, delta: i64) {
        *self
            .metrics
            .borrow_mut()
            .entry(metric.to_owned())
            .or_default() += delta;
    }

    fn record(&self, metric: &str, value: u64) {
        self.add(metric, value as i64);
    }

    fn count(&self, metric: &str) {
        self.add(metric, 1);
    }

    fn set_filter_state(&self, name: &str, value: &str) {
        self.filter_state
            .borrow_mut()
            .insert(name.to_owned(), value.to_owned());
    }
}

impl Mock {
    fn new(route_name: Option<&str>) -> Mock {
        let mock = Mock {
            route_name: route_name.map(str::to_owned),
            ..Mock::default()
        };
        mock.now.set(NOW);
        mock
    }

    fn side_headers(&self, side: Side) -> &RefCell<Pairs> {
        match side {
            Side::Request => &self.request_headers,
            Side::Response => &self.response_headers,
        }
    }

    fn side_body(&self, side: Side) -> &RefCell<Vec<u8>> {
        match side {
            Side::Request => &self.request_body,
            Side::Response => &self.response_body,
        }
    }

    fn header(&self, side: Side, name: &str) -> Option<String> {
        self.headers(side).get(name).map(str::to_owned)
    }

    fn metric(&self, name: &str) -> i64 {
        self.metrics.borrow().get(name).copied().unwrap_or(0)
    }

    /// The local reply sent, its body as JSON.
    fn replied(&self) -> Option<(u16, Value)> {
        let reply = self.reply.borrow();
        let (status, _, body) = reply.as_ref()?;
        Some((*status, serde_json::from_slice(body).unwrap_or(Value::Null)))
    }

    /// What is left of a limit of the tenant's (enforced) at the host's clock.
    fn remaining(&self, tenant: &Tenant, kind: LimitKind) -> u64 {
        self.remaining_in(tenant, kind, Ledger::Enforce)
    }

    fn remaining_in(&self, tenant: &Tenant, kind: LimitKind, ledger: Ledger) -> u64 {
        reservation::standing(&self.store, tenant, ledger, self.now.get())
            .into_iter()
            .find(|s| s.kind == kind)
            .map(|s| s.remaining)
            .unwrap_or_else(|| panic!("no {kind:?} limit"))
    }
}

/// A gateway configured with one key under org `acme`, routes `beta` (shadow) and `dark`
/// (enforced for 0% of requests), and `extra` top-level fields.
fn gateway(limits: Value, extra: Value) -> Rc<Gateway> {
    let mut config = json!({
        "orgs": [{"id": "acme", "limits": limits, "workspaces": [{"id": "w", "projects": [
            {"id": "p", "keys": [{"id": "k", "sha256": hash_key(KEY)}]}]}]}],
        "routes": {"default": {"mode": "enforce"}, "by_name": {
            "beta": {"mode": "shadow"},
            "dark": {"mode": "enforce", "rollout_percent": 0}}},
        "slot_lease_ms": LEASE_MS,
    });
    if let (Some(config), Value::Object(extra)) = (config.as_object_mut(), extra) {
        config.extend(extra);
    }
    let config = Config::parse(config.to_string().as_bytes()).unwrap();
    Rc::new(Gateway::new(config, None, Metrics::default()))
}

fn limits() -> Value {
    json!({"input_tokens_per_minute": 100_000, "output_tokens_per_minute": 100_000,
           "concurrent_requests": 1})
}

/// The tenant the test key authenticates as.
fn tenant(gw: &Gateway) -> Rc<Tenant> {
    Rc::new(
        gw.directory
            .lookup(&hash_key(KEY))
            .unwrap()
            .as_ref()
            .clone(),
    )
}

/// Envoy's shared data once the gateway was configured (`on_configure`).
fn configured(gw: &Gateway, host: &Mock) {
    reservation::initialize(&host.store, gw.directory.tenants(), NOW);
}

/// A configured gateway with [`limits`], a host whose requests are on `route`, and the key's
/// tenant.
fn setup(route: Option<&str>) -> (Rc<Gateway>, Mock, Rc<Tenant>) {
    let gw = gateway(limits(), json!({}));
    let host = Mock::new(route);
    configured(&gw, &host);
    let t = tenant(&gw);
    (gw, host, t)
}

fn chat(max_tokens: Option<u64>) -> Vec<u8> {
    let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hello"}]});
    if let Some(max) = max_tokens {
        body["max_tokens"] = json!(max);
    }
    body.to_string().into_bytes()
}

/// The request's headers arrive: a chat completion with `key`.
fn headers_arrive(x: &mut Exchange, host: &Mock, path: &str, key: Option<&str>) -> Action {
    headers_arrive_with(x, host, path, key, &[])
}

/// [`headers_arrive`] with `extra` headers.
fn headers_arrive_with(
    x: &mut Exchange,
    host: &Mock,
    path: &str,
    key: Option<&str>,
    extra: &[(&str, &str)],
) -> Action {
    let mut headers = vec![
        (":method", "POST".to_owned()),
        (":path", path.to_owned()),
        ("content-type", "application/json".to_owned()),
    ];
    if let Some(key) = key {
        headers.push(("authorization", format!("Bearer {key}")));
    }
    headers.extend(extra.iter().map(|(k, v)| (*k, (*v).to_owned())));
    *host.request_headers.borrow_mut() = headers
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    x.on_headers(host, false)
}

/// The whole body arrives in one chunk.
fn body_arrives(x: &mut Exchange, host: &Mock, body: Vec<u8>) -> Action {
    let size = body.len();
    *host.request_body.borrow_mut() = body;
    x.on_body(host, size, true)
}

/// A request admitted on the default (enforced) route.
fn admitted(gw: &Rc<Gateway>, host: &Mock, max_tokens: Option<u64>) -> Exchange {
    let mut x = Exchange::new(Rc::clone(gw));
    assert_eq!(
        headers_arrive(&mut x, host, "/v1/chat/completions", Some(KEY)),
        Action::Continue
    );
    assert_eq!(
        body_arrives(&mut x, host, chat(max_tokens)),
        Action::Continue
    );
    assert!(host.reply.borrow().is_none(), "{:?}", host.replied());
    x
}

/// The upstream answers `status` with `content_type`, and the body `chunk` (ending it or not).
fn response(x: &mut Exchange, host: &Mock, content_type: &str, chunk: &str, end: bool) {
    *host.response_headers.borrow_mut() =
        pairs(&[(":status", "200"), ("content-type", content_type)]);
    assert_eq!(x.on_response_headers(host, false), Action::Continue);
    *host.response_body.borrow_mut() = chunk.as_bytes().to_vec();
    assert_eq!(x.on_response_body(host, chunk.len(), end), Action::Continue);
}

/// A non-streamed answer reporting its usage.
fn answered(x: &mut Exchange, host: &Mock, prompt_tokens: u64, completion_tokens: u64) {
    let body = json!({"id": "c", "object": "chat.completion", "choices": [],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens}});
    response(x, host, "application/json", &body.to_string(), true);
}

#[test]
fn admit_reserves_at_the_headers_and_the_body_and_settle_charges_the_engine_s_count() {
    let (gw, host, t) = setup(None);
    let mut x = Exchange::new(Rc::clone(&gw));
    assert_eq!(
        headers_arrive(&mut x, &host, "/v1/chat/completions", Some(KEY)),
        Action::Continue
    );
    // The headers took the slot and went on vouched for, the key withheld.
    assert_eq!(host.remaining(&t, LimitKind::Concurrency), 0);
    assert_eq!(gw.in_flight.borrow().len(), 1, "the tick renews its slot");
    let sent = |name| host.header(Side::Request, name);
    assert_eq!(sent("x-weir-tenant").as_deref(), Some("acme/w/p/k"));
    assert_eq!(sent("x-weir-mode").as_deref(), Some("enforce"));
    assert_eq!(sent("authorization"), None);
    assert_eq!(sent("accept-encoding").as_deref(), Some("identity"));
    // The body is held until whole, then its tokens are reserved.
    *host.request_body.borrow_mut() = chat(Some(50));
    assert_eq!(x.on_body(&host, 10, false), Action::Pause);
    assert_eq!(host.remaining(&t, LimitKind::OutputTokens), 100_000);
    assert_eq!(
        body_arrives(&mut x, &host, chat(Some(50))),
        Action::Continue
    );
    assert_eq!(host.remaining(&t, LimitKind::OutputTokens), 100_000 - 50);
    let input = host.remaining(&t, LimitKind::InputTokens);
    assert!(input < 100_000, "the prompt's estimate is held: {input}");
    assert_eq!(
        host.metric(telemetry::RESERVED),
        (100_000 - input + 50) as i64
    );
    // The engine's count replaces the reservation; the slot comes back.
    answered(&mut x, &host, 7, 20);
    assert_eq!(host.remaining(&t, LimitKind::OutputTokens), 100_000 - 20);
    assert_eq!(host.remaining(&t, LimitKind::InputTokens), 100_000 - 7);
    assert_eq!(host.remaining(&t, LimitKind::Concurrency), 1);
    assert!(gw.in_flight.borrow().is_empty());
    assert_eq!(host.metric(telemetry::RESERVED), 0);
    assert_eq!(host.metric(telemetry::TOKENS_OUT), 20);
    x.on_log(&host);
    assert_eq!(host.metric("weir.requests.ok"), 1);
    let decided = "weir.filter.decisions.route.default.mode.enforce.decision.admitted";
    assert_eq!(host.metric(decided), 1);
    let state = host.filter_state.borrow();
    assert_eq!(state["weir.tokens_out"], "20");
    assert_eq!(state["weir.outcome"], "ok");
}

#[test]
fn a_refusal_answers_locally_in_the_caller_s_shape_and_holds_nothing() {
    let (gw, host, _) = setup(None);
    let mut x = Exchange::new(Rc::clone(&gw));
    assert_eq!(
        headers_arrive(&mut x, &host, "/v1/chat/completions", Some("sk-unknown")),
        Action::Pause
    );
    let (status, body) = host.replied().unwrap();
    assert_eq!(status, 401);
    assert_eq!(body["error"]["code"], "invalid_api_key", "{body}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert_eq!(host.metric("weir.rejections.invalid_api_key"), 1);
    assert_eq!(
        host.header(Side::Request, "x-weir-tenant"),
        None,
        "nothing sent on"
    );
    // The Messages API gets Anthropic's shape.
    let mut x = Exchange::new(Rc::clone(&gw));
    assert_eq!(
        headers_arrive(&mut x, &host, "/v1/messages", None),
        Action::Pause
    );
    let (status, body) = host.replied().unwrap();
    assert_eq!(status, 401);
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], "authentication_error", "{body}");
    x.on_log(&host);
    assert_eq!(host.metric("weir.requests.rejected"), 1);
}

#[test]
fn a_request_over_its_limit_is_refused_with_429_and_the_holder_keeps_its_slot() {
    let (gw, host, t) = setup(None);
    let mut first = admitted(&gw, &host, Some(10));
    let mut second = Exchange::new(Rc::clone(&gw));
    assert_eq!(
        headers_arrive(&mut second, &host, "/v1/chat/completions", Some(KEY)),
        Action::Pause
    );
    let (status, body) = host.replied().unwrap();
    assert_eq!(status, 429);
    assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
    assert_eq!(host.metric("weir.rejections.concurrent_requests"), 1);
    second.on_log(&host);
    assert_eq!(
        host.remaining(&t, LimitKind::Concurrency),
        0,
        "still the first's"
    );
    answered(&mut first, &host, 5, 5);
    assert_eq!(host.remaining(&t, LimitKind::Concurrency), 1);
}

#[test]
fn a_body_refused_after_its_headers_were_charged_gives_the_charge_back() {
    let (gw, host, t) = setup(None);
    let mut x = Exchange::new(Rc::clone(&gw));
    headers_arrive(&mut x, &host, "/v1/chat/completions", Some(KEY));
    assert_eq!(host.remaining(&t, LimitKind::Concurrency), 0);
    assert_eq!(
        body_arrives(&mut x, &host, b"{\"model\": ".to_vec()),
        Action::Pause
    );
    let (status, body) = host.replied().unwrap();
    assert_eq!(status, 400);
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert_eq!(host.remaining(&t, LimitKind::Concurrency), 1);
    assert!(gw.in_flight.borrow().is_empty());
}

#[test]
fn shadow_lets_a_refused_request_through_and_records_the_would_reject() {
    let (gw, host, t) = setup(Some("beta"));
    let mut x = Exchange::new(Rc::clone(&gw));
    assert_eq!(
        headers_arrive(&mut x, &host, "/v1/chat/completions", Some("sk-unknown")),
        Action::Continue
    );
    assert!(
        host.reply.borrow().is_none(),
        "shadow never answers locally"
    );
    assert_eq!(host.metric("weir.shadow.rejections.invalid_api_key"), 1);
    assert_eq!(host.metric("weir.rejections.invalid_api_key"), 0);
    assert_eq!(host.metric(telemetry::SHADOW_WOULD_REJECT), 1);
    let tenant_sent = host.header(Side::Request, "x-weir-tenant");
    assert_eq!(
        tenant_sent.as_deref(),
        Some("anonymous"),
        "the default tenant"
    );
    assert_eq!(body_arrives(&mut x, &host, chat(Some(5))), Action::Continue);
    *host.response_headers.borrow_mut() = pairs(&[(":status", "200")]);
    x.on_response_headers(&host, true);
    let verdict = host.header(Side::Response, "x-weir-shadow");
    assert_eq!(
        verdict.as_deref(),
        Some("would-reject; reason=invalid_api_key")
    );
    x.on_log(&host);
    let decided = "weir.filter.decisions.route.beta.mode.shadow.decision.would_reject";
    assert_eq!(host.metric(decided), 1);
    // A valid key on a shadow route is charged to the shadow ledger only.
    let mut x = Exchange::new(Rc::clone(&gw));
    headers_arrive(&mut x, &host, "/v1/chat/completions", Some(KEY));
    assert_eq!(host.remaining(&t, LimitKind::Concurrency), 1);
    let shadow = host.remaining_in(&t, LimitKind::Concurrency, Ledger::Shadow);
    assert_eq!(shadow, 0);
}

#[test]
fn dark_launch_passes_the_request_as_it_came_as_the_default_tenant() {
    let (gw, host, t) = setup(Some("dark"));
    let mut x = Exchange::new(Rc::clone(&gw));
    assert_eq!(
        headers_arrive(
            &mut x,
            &host,
            "/v1/chat/completions",
            Some("not-a-weir-key")
        ),
        Action::Continue
    );
    let sent = |name| host.header(Side::Request, name);
    assert_eq!(
        sent("authorization").as_deref(),
        Some("Bearer not-a-weir-key")
    );
    assert_eq!(sent("x-weir-tenant").as_deref(), Some("anonymous"));
    assert_eq!(sent("x-weir-mode").as_deref(), Some("off"));
    // The body is neither held nor read nor rewritten.
    *host.request_body.borrow_mut() = b"not json".to_vec();
    assert_eq!(x.on_body(&host, 8, true), Action::Continue);
    assert_eq!(&*host.request_body.borrow(), b"not json");
    assert!(host.reply.borrow().is_none());
    assert_eq!(host.remaining(&t, LimitKind::Concurrency), 1);
    x.on_log(&host);
    let decided = "weir.filter.decisions.route.dark.mode.enforce.decision.unmetered";
    assert_eq!(host.metric(decided), 1);
    assert_eq!(host.metric("weir.requests.passthrough"), 1);
}

#[test]
fn an_overrun_at_settle_is_charged_what_the_engine_generated() {
    let (gw, host, t) = setup(None);
    // No output limit: a prediction is reserved (the initial one, before any answer).
    let mut x = admitted(&gw, &host, None);
    let reserved = 100_000 - host.remaining(&t, LimitKind::OutputTokens);
    assert_eq!(reserved, 1_024);
    answered(&mut x, &host, 7, 1_500);
    assert_eq!(host.remaining(&t, LimitKind::OutputTokens), 100_000 - 1_500);
    assert_eq!(host.metric(telemetry::PREDICTION_OVERRUN), 1_500 - 1_024);
    assert_eq!(host.metric(telemetry::TOKENS_OUT), 1_500);
}

#[test]
fn a_client_gone_mid_stream_settles_at_the_log_with_what_was_seen() {
    let (gw, host, t) = setup(None);
    let mut x = Exchange::new(Rc::clone(&gw));
    headers_arrive(&mut x, &host, "/v1/chat/completions", Some(KEY));
    let body = json!({"model": "tiny", "stream": true, "max_tokens": 500,
                      "messages": [{"role": "user", "content": "hello"}]});
    body_arrives(&mut x, &host, body.to_string().into_bytes());
    assert_eq!(host.remaining(&t, LimitKind::OutputTokens), 100_000 - 500);
    let chunk = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"one two three four\"}}]}\n\n";
    response(&mut x, &host, "text/event-stream", chunk, false);
    assert_eq!(
        host.remaining(&t, LimitKind::Concurrency),
        0,
        "still streaming"
    );
    x.on_log(&host);
    let used = 100_000 - host.remaining(&t, LimitKind::OutputTokens);
    assert!(
        (1..500).contains(&used),
        "charged what was seen, not the reservation: {used}"
    );
    assert_eq!(host.remaining(&t, LimitKind::Concurrency), 1);
    assert_eq!(host.metric("weir.requests.cancelled"), 1);
    assert!(gw.in_flight.borrow().is_empty());
}

#[test]
fn a_client_gone_before_its_body_gives_its_slot_back_undecided() {
    let (gw, host, t) = setup(None);
    let mut x = Exchange::new(Rc::clone(&gw));
    headers_arrive(&mut x, &host, "/v1/chat/completions", Some(KEY));
    assert_eq!(host.remaining(&t, LimitKind::Concurrency), 0);
    x.on_log(&host);
    assert_eq!(host.remaining(&t, LimitKind::Concurrency), 1);
    assert_eq!(host.metric("weir.requests.cancelled"), 1);
    let prefix = "weir.filter.decisions.";
    assert!(
        host.metrics.borrow().keys().all(|k| !k.starts_with(prefix)),
        "not decided"
    );
}

#[test]
fn a_trapped_vm_s_slot_comes_back_once_its_lease_lapses() {
    // A VM that traps takes every context on it along (no on_log, no settle): what the
    // exchange left in shared data is a slot lease of `slot_lease_ms`, renewed only by the
    // dead VM's tick (its in-flight map).
    let (gw, host, t) = setup(None);
    let trapped = admitted(&gw, &host, Some(10));
    let held = gw.in_flight.borrow().values().next().cloned().unwrap();
    assert_eq!(held.slot.ttl_ms, LEASE_MS);
    drop(trapped);
    drop(gw);
    // The VM that replaces it shares the store, not the in-flight map.
    let gw = gateway(limits(), json!({}));
    host.now.set(NOW + LEASE_MS - 1);
    let mut x = Exchange::new(Rc::clone(&gw));
    assert_eq!(
        headers_arrive(&mut x, &host, "/v1/chat/completions", Some(KEY)),
        Action::Pause
    );
    assert_eq!(host.replied().unwrap().0, 429, "the slot is still held");
    host.now.set(NOW + LEASE_MS + 1);
    *host.reply.borrow_mut() = None;
    assert_eq!(host.remaining(&t, LimitKind::Concurrency), 1, "lapsed");
    admitted(&gw, &host, Some(10));
}

#[test]
fn a_body_ending_in_trailers_is_admitted_at_the_trailers() {
    let (gw, host, t) = setup(None);
    let mut x = Exchange::new(Rc::clone(&gw));
    headers_arrive(&mut x, &host, "/v1/chat/completions", Some(KEY));
    *host.request_body.borrow_mut() = chat(Some(40));
    assert_eq!(x.on_body(&host, 10, false), Action::Pause);
    assert_eq!(x.on_trailers(&host), Action::Continue);
    assert_eq!(host.remaining(&t, LimitKind::OutputTokens), 100_000 - 40);
    assert!(host.reply.borrow().is_none());
}

#[test]
fn an_upstream_error_or_a_replay_is_charged_nothing() {
    let (gw, host, t) = setup(None);
    for (status, replayed) in [("500", "false"), ("200", "true")] {
        let mut x = admitted(&gw, &host, Some(30));
        *host.response_headers.borrow_mut() = pairs(&[
            (":status", status),
            ("content-type", "application/json"),
            ("idempotent-replayed", replayed),
        ]);
        x.on_response_headers(&host, true);
        assert_eq!(
            host.remaining(&t, LimitKind::OutputTokens),
            100_000,
            "{status}"
        );
        assert_eq!(host.remaining(&t, LimitKind::Concurrency), 1, "{status}");
        x.on_log(&host);
    }
    assert_eq!(host.metric("weir.requests.upstream_error"), 1);
    assert_eq!(host.metric("weir.requests.ok"), 1);
}

#[test]
fn an_ignored_route_passes_as_it_came_and_counts_nothing() {
    let gw = gateway(limits(), json!({"routes": {"default": {"mode": "ignore"}}}));
    let host = Mock::new(None);
    let mut x = Exchange::new(Rc::clone(&gw));
    let action = headers_arrive(
        &mut x,
        &host,
        "/v1/chat/completions",
        Some("x-weir-anything"),
    );
    assert_eq!(action, Action::Continue);
    assert_eq!(host.header(Side::Request, "x-weir-tenant"), None);
    assert!(host.header(Side::Request, "authorization").is_some());
    x.on_log(&host);
    assert!(
        host.metrics.borrow().is_empty(),
        "{:?}",
        host.metrics.borrow()
    );
}

#[test]
fn the_model_list_reports_where_the_key_s_limits_stand() {
    let (gw, host, _) = setup(None);
    let mut x = Exchange::new(Rc::clone(&gw));
    *host.request_headers.borrow_mut() = pairs(&[
        (":method", "GET"),
        (":path", "/v1/models"),
        ("authorization", &format!("Bearer {KEY}")),
    ]);
    assert_eq!(x.on_headers(&host, true), Action::Continue);
    *host.response_headers.borrow_mut() = pairs(&[
        (":status", "200"),
        ("x-ratelimit-remaining-tokens", "999999"),
    ]);
    x.on_response_headers(&host, false);
    let remaining = host.header(Side::Response, "x-ratelimit-remaining-tokens");
    assert_eq!(
        remaining.as_deref(),
        Some("100000"),
        "the upstream's replaced"
    );
    x.on_log(&host);
    let decided = "weir.filter.decisions.route.default.mode.enforce.decision.unmetered";
    assert_eq!(host.metric(decided), 1);
}

/// A gateway whose input tokens are a fleet-wide, fail-closed limit.
fn fleet_gateway() -> Rc<Gateway> {
    let limits = json!({"input_tokens_per_minute": 60_000,
        "fleet_wide": {"input_tokens_per_minute": "fail_closed"}});
    let extra = json!({"signing": {"secret_env": "S"},
        "fleet": {"cluster": "quota", "timeout_ms": 2_000}});
    gateway(limits, extra)
}

/// A request on [`fleet_gateway`] whose body found no lease and waits for its own call.
fn waiting_for_a_lease() -> (Mock, Exchange) {
    let gw = fleet_gateway();
    let host = Mock::new(None);
    configured(&gw, &host);
    let mut x = Exchange::new(Rc::clone(&gw));
    headers_arrive(&mut x, &host, "/v1/chat/completions", Some(KEY));
    assert_eq!(body_arrives(&mut x, &host, chat(Some(5))), Action::Pause);
    assert!(host.reply.borrow().is_none(), "waiting, not refused");
    assert_eq!(host.metric(telemetry::FLEET_LEASES_ASKED_AT_ONCE), 1);
    (host, x)
}

#[test]
fn a_body_without_a_fleet_lease_waits_for_the_call_then_goes_on() {
    let (host, mut x) = waiting_for_a_lease();
    let (cluster, headers, body) = host.calls.borrow()[0].clone();
    assert_eq!(cluster, "quota");
    assert!(headers.contains(&(":path".into(), weir_core::fleet::PATH.into())));
    let ask: LeaseRequest = serde_json::from_slice(&body).unwrap();
    assert!(!ask.counters.is_empty());
    // The service grants what was asked: the body is admitted again and let go.
    let grants = ask.counters.iter().map(|c| Grant {
        key: c.key.clone(),
        granted: c.want,
        remaining: 50_000,
        resets_ms: 0,
        window_start_ms: None,
    });
    let answer = serde_json::to_vec(&LeaseResponse {
        grants: grants.collect(),
    })
    .unwrap();
    *host.call_answer.borrow_mut() = (Some(200), answer.clone());
    x.on_lease(&host, 99, answer.len());
    assert_eq!(host.resumed.get(), 0, "not this request's call");
    x.on_lease(&host, 1, answer.len());
    assert_eq!(host.resumed.get(), 1);
    assert!(host.reply.borrow().is_none());
    answered(&mut x, &host, 7, 3);
    x.on_log(&host);
    assert_eq!(host.metric("weir.requests.ok"), 1);
}

#[test]
fn a_body_whose_fleet_lease_call_fails_is_refused_fail_closed() {
    let (host, mut x) = waiting_for_a_lease();
    *host.call_answer.borrow_mut() = (None, Vec::new());
    x.on_lease(&host, 1, 0);
    assert_eq!(host.resumed.get(), 0, "never let go");
    let (status, body) = host.replied().unwrap();
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "quota_unavailable", "{body}");
    assert_eq!(host.metric("weir.rejections.quota_unavailable"), 1);
}

#[test]
fn an_output_limit_refusal_is_recounted_too() {
    // Without max_tokens the output reserved is the context's rest after the prompt's
    // count: an undercounting estimate reserves more output than the exact count would.
    let limit = |kind| Denial::Limit {
        level: "o".into(),
        kind,
        limit: 100,
        remaining: 0,
        retry_after_ms: 1,
    };
    assert!(depends_on_input(&limit(LimitKind::InputTokens)));
    assert!(depends_on_input(&limit(LimitKind::OutputTokens)));
    assert!(!depends_on_input(&limit(LimitKind::Requests)));
    assert!(!depends_on_input(&limit(LimitKind::Concurrency)));
}

#[test]
fn only_identity_leaves_a_body_readable() {
    assert!(is_identity("identity") && is_identity(" Identity ") && is_identity(""));
    assert!(!is_identity("gzip") && !is_identity("identity, gzip") && !is_identity("br"));
}

#[test]
fn rollout_buckets_are_stable_and_spread() {
    assert_eq!(rollout_bucket("abc"), rollout_bucket("abc"));
    let ids: Vec<u32> = (0..10_000)
        .map(|i| rollout_bucket(&format!("req-{i}")))
        .collect();
    let under_half = ids.iter().filter(|&&b| b < 50).count();
    assert!((4_500..5_500).contains(&under_half), "{under_half}");
    assert!(ids.iter().all(|&b| b < 100));
}

mod retry;

#[test]
fn run_counters_are_counted_under_the_tenant_s_org() {
    let (_gw, host, tenant) = setup(None);
    let mut dotted = tenant.as_ref().clone();
    dotted.org = "acme.eu".into();
    telemetry::runs::run_refused(&host, &dotted, weir_core::run::Budget::ModelCalls);
    telemetry::runs::run_refused(&host, &dotted, weir_core::run::Budget::ModelCalls);
    telemetry::runs::tool_blocked(&host, &dotted, telemetry::runs::ToolWhere::Offered);
    telemetry::runs::retry_refused(&host, &tenant);
    let metrics = host.metrics.borrow();
    let mut names: Vec<(&str, i64)> = metrics.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    names.sort_unstable();
    let org = tenant.org.replace('.', "_");
    let retries = format!("weir.retries_refused_total.tenant.{org}");
    assert_eq!(
        names,
        [
            (retries.as_str(), 1),
            (
                "weir.run_refusals_total.tenant.acme_eu.budget.model_calls",
                2
            ),
            ("weir.tools_blocked_total.tenant.acme_eu.where.offered", 1),
        ]
    );
}

mod run_attacks;
/// A run's budgets held call by call: the run id taken from the caller, bound to its key,
/// charged after the tenant's limits and settled on every exit.
mod runs {
    use super::*;
    use weir_core::run;

    const OTHER_KEY: &str = "sk-weir-test-other-0123";

    /// Two keys of org `acme` whose runs are held to `budgets`, the tables created.
    fn setup_runs(budgets: Value) -> (Rc<Gateway>, Mock) {
        gateway_with_runs(json!({"budgets": budgets}))
    }

    /// Two keys of org `acme` under the run policy `runs`, the route `agents` naming runs in
    /// `x-thread-id` and `shadowed` in shadow mode, the run tables created.
    pub(super) fn gateway_with_runs(runs: Value) -> (Rc<Gateway>, Mock) {
        let config = json!({
            "orgs": [{"id": "acme", "limits": {"input_tokens_per_minute": 100_000,
                    "output_tokens_per_minute": 100_000, "concurrent_requests": 8},
                "policy": {"runs": runs},
                "workspaces": [{"id": "w", "projects": [{"id": "p", "keys": [
                    {"id": "k", "sha256": hash_key(KEY)},
                    {"id": "k2", "sha256": hash_key(OTHER_KEY)}]}]}]}],
            "routes": {"default": {"mode": "enforce"},
                       "by_name": {"agents": {"mode": "enforce", "run_id_header": "x-thread-id"},
                                   "shadowed": {"mode": "shadow"}}},
            "slot_lease_ms": LEASE_MS,
        });
        let config = Config::parse(config.to_string().as_bytes()).unwrap();
        let gw = Rc::new(Gateway::new(config, None, Metrics::default()));
        let host = Mock::new(None);
        configured(&gw, &host);
        run::create(
            &host.store,
            gw.directory.tenants(),
            run::RunTable::default(),
        );
        (gw, host)
    }

    /// A call of run `run_id` (named in `header`) with `key`, its body whole: what the
    /// filter answered, and the exchange.
    fn call(gw: &Rc<Gateway>, host: &Mock, key: &str, header: &str, run_id: &str) -> Exchange {
        *host.reply.borrow_mut() = None;
        let mut x = Exchange::new(Rc::clone(gw));
        *host.request_headers.borrow_mut() = pairs(&[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("authorization", &format!("Bearer {key}")),
            (header, run_id),
        ]);
        x.on_headers(host, false);
        if host.reply.borrow().is_none() {
            body_arrives(&mut x, host, chat(Some(10)));
        }
        x
    }

    fn refused_budget(host: &Mock) -> Option<String> {
        let (status, body) = host.replied()?;
        assert_eq!(status, 429, "{body}");
        assert_eq!(body["error"]["code"], "run_budget_exceeded", "{body}");
        body["error"]["budget"].as_str().map(str::to_owned)
    }

    #[test]
    fn approval_class_tools_are_vouched_for_the_sidecar_to_hold() {
        let config = json!({
            "orgs": [{"id": "acme", "policy": {"tools": {
                    "classes": {"deploy_*": "approval", "send_email": "side_effect"}}},
                "workspaces": [{"id": "w", "projects": [{"id": "p", "keys": [
                    {"id": "k", "sha256": hash_key(KEY)}]}]}]}],
            "routes": {"default": {"mode": "enforce"}},
        });
        let config = Config::parse(config.to_string().as_bytes()).unwrap();
        let gw = Rc::new(Gateway::new(config, None, Metrics::default()));
        let host = Mock::new(None);
        configured(&gw, &host);
        let mut x = Exchange::new(Rc::clone(&gw));
        headers_arrive(&mut x, &host, "/v1/chat/completions", Some(KEY));
        assert_eq!(
            host.header(Side::Request, "x-weir-tool-approval")
                .as_deref(),
            Some("deploy_*")
        );
        // A key without approval tools sends none, and a caller's own is stripped.
        let (gw, host) = setup_runs(json!({"model_calls": 1}));
        let mut x = Exchange::new(Rc::clone(&gw));
        *host.request_headers.borrow_mut() = pairs(&[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("authorization", &format!("Bearer {KEY}")),
            ("x-weir-tool-approval", "*"),
        ]);
        x.on_headers(&host, false);
        assert_eq!(host.header(Side::Request, "x-weir-tool-approval"), None);
    }

    #[test]
    fn the_call_that_would_cross_the_model_call_budget_is_refused_holding_nothing() {
        let (gw, host) = setup_runs(json!({"model_calls": 2}));
        let t = tenant(&gw);
        for _ in 0..2 {
            let mut x = call(&gw, &host, KEY, "x-weir-run-id", "r1");
            assert!(host.replied().is_none(), "{:?}", host.replied());
            // The run id goes on vouched, as the caller named it.
            assert_eq!(
                host.header(Side::Request, "x-weir-run-id").as_deref(),
                Some("r1")
            );
            answered(&mut x, &host, 5, 5);
            x.on_log(&host);
        }
        let before = host.remaining(&t, LimitKind::InputTokens);
        let mut x = call(&gw, &host, KEY, "x-weir-run-id", "r1");
        assert_eq!(refused_budget(&host).as_deref(), Some("model_calls"));
        let (_, body) = host.replied().unwrap();
        assert_eq!(
            (
                body["error"]["limit"].as_u64(),
                body["error"]["used"].as_u64()
            ),
            (Some(2), Some(2))
        );
        let reply = host.reply.borrow().clone().unwrap();
        let header = |n: &str| reply.1.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
        assert_eq!(
            header("x-weir-run-budget").as_deref(),
            Some("model_calls=2/2")
        );
        assert_eq!(header("x-should-retry").as_deref(), Some("false"));
        x.on_log(&host);
        // The tenant's reservation went back with the refusal.
        assert_eq!(host.remaining(&t, LimitKind::InputTokens), before);
        assert_eq!(host.remaining(&t, LimitKind::Concurrency), 8);
        assert_eq!(host.metric("weir.rejections.run_budget_exceeded"), 1);
        let by_tenant = "weir.run_refusals_total.tenant.acme.budget.model_calls";
        assert_eq!(host.metric(by_tenant), 1);
        // Another run of the key, and the same run id of another key, are untouched.
        let mut x = call(&gw, &host, KEY, "x-weir-run-id", "r2");
        assert!(host.replied().is_none());
        answered(&mut x, &host, 5, 5);
        x.on_log(&host);
        let mut x = call(&gw, &host, OTHER_KEY, "x-weir-run-id", "r1");
        assert!(host.replied().is_none(), "another key's r1 is another run");
        answered(&mut x, &host, 5, 5);
        x.on_log(&host);
    }

    #[test]
    fn a_call_that_ends_without_its_answer_gives_its_place_back_at_the_log() {
        let (gw, host) = setup_runs(json!({"parallel_calls": 1}));
        let mut first = call(&gw, &host, KEY, "x-weir-run-id", "r");
        assert!(host.replied().is_none());
        assert_eq!(
            gw.runs_in_flight.borrow().len(),
            1,
            "the tick renews its place"
        );
        // A second call of the run while the first is in flight passes the run's one place.
        call(&gw, &host, KEY, "x-weir-run-id", "r").on_log(&host);
        assert_eq!(refused_budget(&host).as_deref(), Some("parallel_calls"));
        // The client goes away before any answer: the log settles the run.
        first.on_log(&host);
        assert!(gw.runs_in_flight.borrow().is_empty());
        let mut third = call(&gw, &host, KEY, "x-weir-run-id", "r");
        assert!(host.replied().is_none(), "{:?}", host.replied());
        third.on_log(&host);
    }

    #[test]
    fn an_upstream_refusal_or_a_replay_gives_the_model_call_back() {
        let (gw, host) = setup_runs(json!({"model_calls": 1}));
        let mut x = call(&gw, &host, KEY, "x-weir-run-id", "r");
        *host.response_headers.borrow_mut() =
            pairs(&[(":status", "429"), ("content-type", "application/json")]);
        x.on_response_headers(&host, false);
        let body = br#"{"error":{"message":"queue full","type":"requests"}}"#;
        *host.response_body.borrow_mut() = body.to_vec();
        x.on_response_body(&host, body.len(), true);
        x.on_log(&host);
        let mut x = call(&gw, &host, KEY, "x-weir-run-id", "r");
        assert!(
            host.replied().is_none(),
            "the refused call ran no model: {:?}",
            host.replied()
        );
        answered(&mut x, &host, 3, 3);
        x.on_log(&host);
        call(&gw, &host, KEY, "x-weir-run-id", "r").on_log(&host);
        assert_eq!(refused_budget(&host).as_deref(), Some("model_calls"));
    }

    #[test]
    fn a_route_s_run_id_header_names_the_run_and_bad_ids_are_refused() {
        let (gw, host) = setup_runs(json!({"model_calls": 1}));
        let mut host = host;
        host.route_name = Some("agents".into());
        let mut x = call(&gw, &host, KEY, "x-thread-id", "t1");
        assert_eq!(
            host.header(Side::Request, "x-weir-run-id").as_deref(),
            Some("t1")
        );
        answered(&mut x, &host, 3, 3);
        x.on_log(&host);
        call(&gw, &host, KEY, "x-thread-id", "t1").on_log(&host);
        assert_eq!(refused_budget(&host).as_deref(), Some("model_calls"));
        // On that route weir's own header names nothing (and is stripped).
        let mut x = call(&gw, &host, KEY, "x-weir-run-id", "t1");
        assert!(host.replied().is_none());
        assert_eq!(host.header(Side::Request, "x-weir-run-id"), None);
        x.on_log(&host);
        for bad in ["", "has space", &"x".repeat(129), "caf\u{e9}"] {
            call(&gw, &host, KEY, "x-thread-id", bad).on_log(&host);
            let (status, body) = host.replied().unwrap();
            assert_eq!(
                (status, body["error"]["code"].as_str()),
                (400, Some("invalid_run_id")),
                "{bad:?}"
            );
        }
    }
}

/// A run's fleet-wide budgets: each call reserved in the quota store with its body waiting,
/// refused as the store says, and settled from the root tick.
mod run_fleet {
    use super::*;
    use weir_core::run::fleet::{
        Measure, RESERVE_PATH, ReserveAnswer, ReserveAsk, SETTLE_PATH, SettleBatch,
    };

    /// A key whose runs hold `model_calls: 10` fleet-wide and `local` on each Envoy.
    fn setup(local: Value) -> (Rc<Gateway>, Mock) {
        let mut budgets = json!({"model_calls": 10});
        if let (Some(b), Value::Object(local)) = (budgets.as_object_mut(), local) {
            b.extend(local);
        }
        let config = json!({
            "orgs": [{"id": "acme", "limits": {"input_tokens_per_minute": 100_000,
                    "concurrent_requests": 8},
                "policy": {"runs": {"budgets": budgets,
                                    "fleet_wide": {"model_calls": "fail_closed"}}},
                "workspaces": [{"id": "w", "projects": [{"id": "p", "keys": [
                    {"id": "k", "sha256": hash_key(KEY)}]}]}]}],
            "routes": {"default": {"mode": "enforce"}},
            "slot_lease_ms": LEASE_MS,
            "fleet": {"cluster": "quota", "timeout_ms": 2_000},
        });
        let config = Config::parse(config.to_string().as_bytes()).unwrap();
        let gw = Rc::new(Gateway::new(config, None, Metrics::default()));
        let host = Mock::new(None);
        configured(&gw, &host);
        weir_core::run::create(
            &host.store,
            gw.directory.tenants(),
            weir_core::run::RunTable::default(),
        );
        (gw, host)
    }

    /// A call of run `r1` whose body arrived: what the filter did with it.
    fn call(gw: &Rc<Gateway>, host: &Mock) -> (Exchange, Action) {
        *host.reply.borrow_mut() = None;
        let mut x = Exchange::new(Rc::clone(gw));
        *host.request_headers.borrow_mut() = pairs(&[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("authorization", &format!("Bearer {KEY}")),
            ("x-weir-run-id", "r1"),
        ]);
        x.on_headers(host, false);
        let action = body_arrives(&mut x, host, chat(Some(10)));
        (x, action)
    }

    /// The last call sent: its path and body.
    fn last_call(host: &Mock) -> (String, Vec<u8>) {
        let calls = host.calls.borrow();
        let (cluster, headers, body) = calls.last().cloned().unwrap();
        assert_eq!(cluster, "quota");
        let path = headers
            .iter()
            .find(|(k, _)| k == ":path")
            .unwrap()
            .1
            .clone();
        (path, body)
    }

    fn store_answers(x: &mut Exchange, host: &Mock, status: Option<u16>, answer: &ReserveAnswer) {
        let body = serde_json::to_vec(answer).unwrap();
        *host.call_answer.borrow_mut() = (status, body.clone());
        let token = host.calls.borrow().len() as u32;
        x.on_run_reserved(host, token + 1, body.len());
        assert_eq!(host.resumed.get(), 0, "not this call's answer");
        x.on_run_reserved(host, token, body.len());
    }

    #[test]
    fn a_call_waits_for_the_store_goes_on_when_admitted_and_its_settle_goes_from_the_tick() {
        let (gw, host) = setup(json!({}));
        let (mut x, action) = call(&gw, &host);
        assert_eq!(action, Action::Pause, "the body waits for the store");
        let (path, body) = last_call(&host);
        assert_eq!(path, RESERVE_PATH);
        let ask: ReserveAsk = serde_json::from_slice(&body).unwrap();
        assert!(ask.run.starts_with("weir:run:acme/w/p/k:"), "{}", ask.run);
        assert_eq!(ask.measures.len(), 1);
        assert_eq!(
            (
                ask.measures[0].measure,
                ask.measures[0].limit,
                ask.measures[0].demand
            ),
            (Measure::ModelCalls, 10, 1)
        );
        store_answers(&mut x, &host, Some(200), &ReserveAnswer::Admitted);
        assert_eq!(host.resumed.get(), 1);
        assert!(host.replied().is_none());
        assert!(gw.run_settles.borrow().is_empty(), "settled at the end");
        answered(&mut x, &host, 5, 4);
        x.on_log(&host);
        let queued = gw.run_settles.borrow().clone();
        assert_eq!(queued.len(), 1);
        assert_eq!(queued[0].call, ask.call);
        assert_eq!(queued[0].measures[0].actual, 1, "a model ran");
        // The root tick sends the queue as one batch.
        super::super::run_fleet::send_settles(&host, &gw);
        let (path, body) = last_call(&host);
        assert_eq!(path, SETTLE_PATH);
        let batch: SettleBatch = serde_json::from_slice(&body).unwrap();
        assert_eq!(batch.settles, Vec::from(queued));
        assert!(gw.run_settles.borrow().is_empty());
    }

    #[test]
    fn a_refusal_by_the_store_is_run_budget_exceeded_and_gives_the_tenant_s_charge_back() {
        let (gw, host) = setup(json!({}));
        let t = tenant(&gw);
        let before = host.remaining(&t, LimitKind::InputTokens);
        let (mut x, _) = call(&gw, &host);
        let refused = ReserveAnswer::Refused {
            budget: "model_calls".into(),
            limit: 10,
            used: 10,
        };
        store_answers(&mut x, &host, Some(200), &refused);
        assert_eq!(host.resumed.get(), 0, "never let go");
        let (status, body) = host.replied().unwrap();
        assert_eq!(
            (
                status,
                body["error"]["code"].as_str(),
                body["error"]["used"].as_u64()
            ),
            (429, Some("run_budget_exceeded"), Some(10)),
            "{body}"
        );
        let reply = host.reply.borrow().clone().unwrap();
        assert!(
            reply
                .1
                .contains(&("x-weir-run-budget".into(), "model_calls=10/10".into()))
        );
        x.on_log(&host);
        assert_eq!(host.remaining(&t, LimitKind::InputTokens), before);
        assert_eq!(host.remaining(&t, LimitKind::Concurrency), 8);
        assert!(
            gw.run_settles.borrow().is_empty(),
            "nothing reserved in the store"
        );
    }

    #[test]
    fn a_store_that_does_not_answer_refuses_the_call_as_a_fleet_limit_does() {
        let (gw, host) = setup(json!({}));
        let (mut x, _) = call(&gw, &host);
        store_answers(&mut x, &host, None, &ReserveAnswer::Admitted);
        assert_eq!(host.resumed.get(), 0, "never let go");
        let (status, body) = host.replied().unwrap();
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (429, Some("quota_unavailable")),
            "{body}"
        );
        let retry_after = (host.reply.borrow().as_ref().unwrap().1.iter())
            .find(|(k, _)| k == "retry-after")
            .map(|(_, v)| v.clone());
        assert!(retry_after.is_some_and(|s| s.parse::<u64>().unwrap() >= 1));
        assert_eq!(host.metric("weir.rejections.quota_unavailable"), 1);
        // A 503 from the service is no answer either.
        let (mut x, _) = call(&gw, &host);
        store_answers(&mut x, &host, Some(503), &ReserveAnswer::Admitted);
        assert_eq!(host.replied().map(|r| r.0), Some(429));
    }

    #[test]
    fn a_caller_gone_before_the_answer_settles_as_having_used_nothing() {
        let (gw, host) = setup(json!({}));
        let (mut x, _) = call(&gw, &host);
        x.on_log(&host);
        let queued = gw.run_settles.borrow().clone();
        assert_eq!(queued.len(), 1);
        assert_eq!(
            (queued[0].measures[0].reserved, queued[0].measures[0].actual),
            (1, 0)
        );
    }

    #[test]
    fn budgets_held_on_this_envoy_refuse_before_the_store_is_asked() {
        let (gw, host) = setup(json!({"parallel_calls": 1}));
        let (_first, action) = call(&gw, &host);
        assert_eq!(action, Action::Pause);
        assert_eq!(host.calls.borrow().len(), 1);
        let (mut second, _) = call(&gw, &host);
        let (status, body) = host.replied().unwrap();
        assert_eq!(
            (status, body["error"]["budget"].as_str()),
            (429, Some("parallel_calls")),
            "{body}"
        );
        assert_eq!(host.calls.borrow().len(), 1, "the store was not asked");
        second.on_log(&host);
        assert!(gw.run_settles.borrow().is_empty());
    }
}
mod tools;
#[test]
fn the_approvals_api_goes_on_unmetered_with_the_key_s_approver_scopes_vouched() {
    let config = json!({
        "orgs": [{"id": "acme", "workspaces": [{"id": "w", "projects": [{"id": "p", "keys": [
            {"id": "ops", "sha256": hash_key(KEY), "approves": ["acme/w"]},
            {"id": "dev", "sha256": hash_key("sk-weir-dev-0123456789")}]}]}]}],
        "routes": {"default": {"mode": "enforce"}},
    });
    let config = Config::parse(config.to_string().as_bytes()).unwrap();
    let gw = Rc::new(Gateway::new(config, None, Metrics::default()));
    let host = Mock::new(None);
    configured(&gw, &host);
    let ask = |key: &str, method: &str, path: &str| {
        let mut x = Exchange::new(Rc::clone(&gw));
        *host.request_headers.borrow_mut() = pairs(&[
            (":method", method),
            (":path", path),
            ("authorization", &format!("Bearer {key}")),
        ]);
        let action = x.on_headers(&host, true);
        x.on_log(&host);
        (action, host.header(Side::Request, "x-weir-approves"))
    };
    let approve = "/v1/weir/approvals/apr_x/approve";
    assert_eq!(
        ask(KEY, "POST", approve),
        (Action::Continue, Some("acme/w".to_owned()))
    );
    assert_eq!(
        host.header(Side::Request, "x-weir-tenant").as_deref(),
        Some("acme/w/p/ops")
    );
    // A key that approves nothing is forwarded without scopes: the sidecar refuses it.
    let dev = ask("sk-weir-dev-0123456789", "GET", "/v1/weir/approvals");
    assert_eq!(dev, (Action::Continue, None));
    // A forged header is stripped, the wrong method refused, an unknown key refused.
    *host.reply.borrow_mut() = None;
    let (_, scopes) = ask("sk-weir-nobody-000000000", "GET", "/v1/weir/approvals");
    assert_eq!(scopes, None);
    assert_eq!(host.reply.borrow().as_ref().map(|r| r.0), Some(401));
    *host.reply.borrow_mut() = None;
    ask(KEY, "GET", approve);
    assert_eq!(host.reply.borrow().as_ref().map(|r| r.0), Some(405));
}
