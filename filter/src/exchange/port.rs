//! What the exchange needs of its host, and nothing more: a side's headers and body, a local
//! reply, shared data as core's [`SharedStore`], the clock, random ids, route properties,
//! calls to the quota service, metrics and access-log state. Envoy's implementation is
//! `crate::host::Envoy`; the exchange's tests implement it in memory, so every transition runs
//! natively. Every method takes `&self`: a callback's decisions call the host in any order, and
//! a host keeps what little state it has (a test's record of calls) inside.

use proxy_wasm::types::Status;
use weir_core::reply::Reply;
use weir_core::store::SharedStore;

/// The host calls an exchange makes.
pub trait Host {
    /// Shared data, visible to every worker VM with the same `vm_id`.
    type Store: SharedStore;

    fn store(&self) -> &Self::Store;

    /// Milliseconds since the Unix epoch (one instant per callback).
    fn now_ms(&self) -> u64;

    /// A random 64-bit id (a slot lease's).
    fn random_u64(&self) -> u64;

    /// weir's id of one attempt (`x-weir-request-id`): random, so no caller can choose it.
    fn unique_id(&self) -> String;

    /// A property as UTF-8 (route name, route metadata leaves, ...).
    fn property(&self, path: &[&str]) -> Option<String>;

    /// A side's headers, only in that side's headers callback (see [`Side`]).
    fn headers(&self, side: Side) -> Headers;

    /// Sets (or with `None` removes) a header; only valid before the headers are sent on.
    fn set_header(&self, side: Side, name: &str, value: Option<&str>);

    /// The first `size` bytes of a side's body buffer.
    fn body(&self, side: Side, size: usize) -> Vec<u8>;

    /// Replaces the whole current body buffer of `size` bytes.
    fn replace_body(&self, side: Side, size: usize, value: &[u8]);

    /// Answers the request locally; the host stops forwarding it.
    fn local_reply(&self, status: u16, headers: &[(&str, String)], body: &[u8]);

    /// Answers the request locally once [`crate::tarpit::HOLD_MS`] have passed (the request
    /// stays paused until then), or at once when no more replies can be held.
    fn hold_reply(&self, reply: Reply);

    /// Lets a request held for a call's answer (its body paused) go on.
    fn resume_request(&self);

    /// Sends a call to `cluster`; the answer comes back with the returned token.
    fn dispatch(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u64,
    ) -> Result<u32, Status>;

    /// The status and body of a dispatched call's answer (no status: it failed or timed out).
    fn call_response(&self, body_size: usize) -> (Option<u16>, Vec<u8>);

    /// Adds to a counter or gauge defined at configuration (negative only for gauges).
    fn add(&self, metric: &str, delta: i64);

    /// Records a value in a histogram defined at configuration.
    fn record(&self, metric: &str, value: u64);

    /// Adds one to a counter whose name is known only at run time, defining it on first use.
    fn count(&self, metric: &str);

    /// Writes a filter-state entry `wasm.<name>`, read by access logs.
    fn set_filter_state(&self, name: &str, value: &str);
}

/// Which side of the exchange a header or body call is about.
///
/// A side's headers exist only until they go on: request headers may be read and written in
/// the request-headers callback alone (weir sends them on at its end), response headers in the
/// response-headers callback. Outside it Envoy answers `BadArgument`, on which the SDK's
/// hostcall panics — a trapped VM — so header calls belong in those callbacks only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Request,
    Response,
}

/// A side's headers as they arrived, read in one host call so that looking one up costs none.
/// Envoy's own lookup answers a header's first value; so does [`Headers::get`].
pub struct Headers(Vec<(String, String)>);

impl Headers {
    pub fn new(pairs: Vec<(String, String)>) -> Headers {
        Headers(pairs)
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(k, _)| k.as_str())
    }
}
