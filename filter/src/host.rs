//! The thin layer over proxy-wasm host calls: shared data as a [`SharedStore`], the clock,
//! properties, headers and bodies, local replies, calls and metrics, and [`Envoy`], the
//! exchange's [`Host`] made of them. Host calls that can fail report it; nothing here panics.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType, Status};
use weir_core::reply::Reply;
use weir_core::store::{SharedStore, StoreError};

use crate::Gateway;
use crate::exchange::{Headers, Host, Side};

/// Counts a host call in the profile build ([`crate::profile`]); nothing otherwise.
#[inline(always)]
fn counted() {
    #[cfg(feature = "profile")]
    crate::profile::host_call();
}

thread_local! {
    /// Envoy's clock as first read in the callback under way, if one is ([`callback`]).
    static CALLBACK_NOW: Cell<Option<Option<u64>>> = const { Cell::new(None) };
}

/// Runs one of a request's callbacks: every decision in it sees one instant, so Envoy's clock
/// is read at most once per callback. In the profile build it is a stage.
pub fn callback<T>(name: &'static str, f: impl FnOnce() -> T) -> T {
    CALLBACK_NOW.with(|now| now.set(Some(None)));
    let result = staged(name, f);
    CALLBACK_NOW.with(|now| now.set(None));
    result
}

/// Runs `f` as a stage of the profile build ([`crate::profile`]); just runs it otherwise.
#[inline(always)]
pub fn staged<T>(name: &'static str, f: impl FnOnce() -> T) -> T {
    #[cfg(feature = "profile")]
    let _stage = crate::profile::stage(name);
    #[cfg(not(feature = "profile"))]
    let _ = name;
    f()
}

/// Reports the request's stages in the profile build; nothing otherwise.
#[inline(always)]
pub fn report_stages() {
    #[cfg(feature = "profile")]
    crate::profile::report();
}

/// Envoy's shared data, visible to every worker VM with the same `vm_id`.
pub struct SharedData;

impl SharedStore for SharedData {
    fn load(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        counted();
        match hostcalls::get_shared_data(key) {
            Ok((Some(value), Some(cas))) => Some((value, cas)),
            _ => None,
        }
    }

    fn store(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        counted();
        hostcalls::set_shared_data(key, Some(value), cas).map_err(|status| match status {
            Status::CasMismatch => StoreError::CasMismatch,
            _ => StoreError::Failed,
        })
    }
}

/// Milliseconds since the Unix epoch by Envoy's clock (read once per [`callback`]).
pub fn now_ms() -> u64 {
    let cached = CALLBACK_NOW.with(Cell::get);
    if let Some(Some(now)) = cached {
        return now;
    }
    counted();
    let now = hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64);
    if cached.is_some() {
        CALLBACK_NOW.with(|c| c.set(Some(Some(now))));
    }
    now
}

/// Random bits from WASI (the clock's if WASI has none), so ids never collide across workers.
fn random_bytes<const N: usize>() -> [u8; N] {
    let mut bytes = [0u8; N];
    counted();
    if getrandom::fill(&mut bytes).is_err() {
        let now = now_ms().to_le_bytes();
        let n = N.min(now.len());
        bytes[..n].copy_from_slice(&now[..n]);
    }
    bytes
}

/// weir's id of one attempt (`x-weir-request-id`): random, so no caller can choose or predict it.
pub fn unique_id() -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut id = String::with_capacity(37);
    id.push_str("weir-");
    for b in random_bytes::<16>() {
        id.push(char::from(HEX[usize::from(b >> 4)]));
        id.push(char::from(HEX[usize::from(b & 0xf)]));
    }
    id
}

/// A variable of the VM's environment (Envoy passes the host's variables listed in
/// `vm_config.environment_variables.host_env_keys`; WASI's `environ_get` reads them).
pub fn env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// A random 64-bit id (a slot lease's).
pub fn random_u64() -> u64 {
    u64::from_le_bytes(random_bytes())
}

/// A property as UTF-8 (route name, route metadata leaves, ...).
pub fn property(path: Vec<&str>) -> Option<String> {
    counted();
    let bytes = hostcalls::get_property(path).ok()??;
    String::from_utf8(bytes).ok()
}

/// Writes a filter-state entry `wasm.<name>`, read by access logs as
/// `%FILTER_STATE(wasm.<name>:PLAIN)%`.
pub fn set_filter_state(name: &str, value: &str) {
    counted();
    let _ = hostcalls::set_property(vec![name], Some(value.as_bytes()));
}

/// Counters, gauges and histograms defined once per VM. Envoy keeps them in its stats store
/// (as `wasmcustom.<name>`), summed across workers.
#[derive(Default)]
pub struct Metrics {
    /// Each name's id, `None` once Envoy refused to define it: a name is defined at most once
    /// per VM, also those named at run time ([`Metrics::count`]).
    ids: RefCell<HashMap<String, Option<u32>>>,
}

impl Metrics {
    pub fn define(&mut self, kind: MetricType, name: &str) {
        let id = define_metric(kind, name);
        self.ids.get_mut().insert(name.to_owned(), id);
    }

    /// Adds to a counter or gauge (negative only for gauges).
    pub fn add(&self, name: &str, delta: i64) {
        if let (Some(id), true) = (self.id(name), delta != 0) {
            counted();
            let _ = hostcalls::increment_metric(id, delta);
        }
    }

    pub fn record(&self, name: &str, value: u64) {
        if let Some(id) = self.id(name) {
            counted();
            let _ = hostcalls::record_metric(id, value);
        }
    }

    /// Adds one to a counter whose name is known only at run time (it carries a route's name),
    /// defining it on first use.
    pub fn count(&self, name: &str) {
        // Callbacks never nest, so the map is never borrowed here; if it were, skip the count.
        let Ok(mut ids) = self.ids.try_borrow_mut() else {
            return;
        };
        let id = *ids
            .entry(name.to_owned())
            .or_insert_with(|| define_metric(MetricType::Counter, name));
        if let Some(id) = id {
            counted();
            let _ = hostcalls::increment_metric(id, 1);
        }
    }

    fn id(&self, name: &str) -> Option<u32> {
        self.ids.try_borrow().ok()?.get(name).copied().flatten()
    }
}

fn define_metric(kind: MetricType, name: &str) -> Option<u32> {
    hostcalls::define_metric(kind, name)
        .map_err(|status| log::warn!("weir: cannot define metric {name}: {status:?}"))
        .ok()
}

fn map_type(side: Side) -> MapType {
    match side {
        Side::Request => MapType::HttpRequestHeaders,
        Side::Response => MapType::HttpResponseHeaders,
    }
}

fn buffer_type(side: Side) -> BufferType {
    match side {
        Side::Request => BufferType::HttpRequestBody,
        Side::Response => BufferType::HttpResponseBody,
    }
}

/// A side's headers, read in one host call. Only in the side's headers callback (see
/// [`Side`]). Values are read as bytes: HTTP/1.1 lets a value carry bytes that are not UTF-8,
/// on which the SDK's string reading panics (a trapped VM); such bytes read as U+FFFD, so such
/// a key is simply not a known one.
pub fn headers(side: Side) -> Headers {
    counted();
    let pairs = hostcalls::get_map_bytes(map_type(side)).unwrap_or_default();
    Headers::new(
        pairs
            .into_iter()
            .map(|(name, value)| (name, String::from_utf8_lossy(&value).into_owned()))
            .collect(),
    )
}

/// Sets (or with `None` removes) a header; only valid before the headers are sent on.
pub fn set_header(side: Side, name: &str, value: Option<&str>) {
    counted();
    if let Err(status) = hostcalls::set_map_value(map_type(side), name, value) {
        log::debug!("weir: cannot set header {name}: {status:?}");
    }
}

pub fn body(side: Side, size: usize) -> Vec<u8> {
    counted();
    hostcalls::get_buffer(buffer_type(side), 0, size)
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// Replaces the whole current body buffer of `size` bytes.
pub fn replace_body(side: Side, size: usize, value: &[u8]) {
    counted();
    if let Err(status) = hostcalls::set_buffer(buffer_type(side), 0, size, value) {
        log::warn!("weir: cannot replace body: {status:?}");
    }
}

/// Answers the request locally; Envoy stops forwarding it.
pub fn local_reply(status: u16, headers: &[(&str, String)], body: &[u8]) {
    counted();
    let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    if let Err(s) = hostcalls::send_http_response(u32::from(status), headers, Some(body)) {
        log::warn!("weir: cannot send local reply: {s:?}");
    }
}

/// Sends a held reply on the request context it answers (from the root context's tick), unless
/// that request has ended meanwhile.
pub fn reply_on(context_id: u32, reply: &Reply) {
    if hostcalls::set_effective_context(context_id).is_err() {
        return;
    }
    local_reply(reply.status, &reply.headers, &reply.body);
}

/// Lets a request held for a call's answer (its body paused) go on.
pub fn resume_request() {
    counted();
    if let Err(status) = hostcalls::resume_http_request() {
        log::warn!("weir: cannot resume the request: {status:?}");
    }
}

/// Sends a call to `cluster` (a lease renewal, or a request's own ask); the answer comes to
/// the calling context's `on_http_call_response` with the returned token.
pub fn dispatch(
    cluster: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout_ms: u64,
) -> Result<u32, Status> {
    hostcalls::dispatch_http_call(
        cluster,
        headers.to_vec(),
        Some(body),
        Vec::new(),
        Duration::from_millis(timeout_ms),
    )
}

/// The status and body of a dispatched call's answer (no status: it failed or timed out).
pub fn call_response(body_size: usize) -> (Option<u16>, Vec<u8>) {
    let status = hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status")
        .ok()
        .flatten()
        .and_then(|s| s.parse().ok());
    let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
        .ok()
        .flatten()
        .unwrap_or_default();
    (status, body)
}

/// Envoy as the host of an exchange (`crate::exchange`): each call one of the functions above,
/// metrics the gateway's.
pub struct Envoy {
    gw: Rc<Gateway>,
    /// The request context it serves (0: the root context's).
    context_id: u32,
}

impl Envoy {
    /// The host of the root context's work.
    pub fn new(gw: Rc<Gateway>) -> Envoy {
        Envoy { gw, context_id: 0 }
    }

    /// The host of the request on `context_id`.
    pub fn of_request(gw: Rc<Gateway>, context_id: u32) -> Envoy {
        Envoy { gw, context_id }
    }
}

impl Host for Envoy {
    type Store = SharedData;

    fn store(&self) -> &SharedData {
        &SharedData
    }

    fn now_ms(&self) -> u64 {
        now_ms()
    }

    fn random_u64(&self) -> u64 {
        random_u64()
    }

    fn unique_id(&self) -> String {
        unique_id()
    }

    fn property(&self, path: &[&str]) -> Option<String> {
        property(path.to_vec())
    }

    fn headers(&self, side: Side) -> Headers {
        headers(side)
    }

    fn set_header(&self, side: Side, name: &str, value: Option<&str>) {
        set_header(side, name, value);
    }

    fn body(&self, side: Side, size: usize) -> Vec<u8> {
        body(side, size)
    }

    fn replace_body(&self, side: Side, size: usize, value: &[u8]) {
        replace_body(side, size, value);
    }

    fn local_reply(&self, status: u16, headers: &[(&str, String)], body: &[u8]) {
        local_reply(status, headers, body);
    }

    fn hold_reply(&self, reply: Reply) {
        let held = match self.gw.tarpit.try_borrow_mut() {
            Ok(mut tarpit) => tarpit.hold(self.context_id, reply, now_ms()),
            Err(_) => Err(reply),
        };
        if let Err(reply) = held {
            local_reply(reply.status, &reply.headers, &reply.body);
        }
    }

    fn resume_request(&self) {
        resume_request();
    }

    fn dispatch(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u64,
    ) -> Result<u32, Status> {
        dispatch(cluster, headers, body, timeout_ms)
    }

    fn call_response(&self, body_size: usize) -> (Option<u16>, Vec<u8>) {
        call_response(body_size)
    }

    fn add(&self, metric: &str, delta: i64) {
        self.gw.metrics.add(metric, delta);
    }

    fn record(&self, metric: &str, value: u64) {
        self.gw.metrics.record(metric, value);
    }

    fn count(&self, metric: &str) {
        self.gw.metrics.count(metric);
    }

    fn set_filter_state(&self, name: &str, value: &str) {
        set_filter_state(name, value);
    }
}
