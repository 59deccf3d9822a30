//! Finds a replica's [`Isolation`] mode by asking it, each time it joins.
//!
//! A few short chat completions (`max_tokens: 1`, not streamed) with one prompt — a random
//! nonce, then about 300 tokens of filler: many of vLLM's 16-token cache blocks, and far more
//! than the one token llama.cpp always recomputes — read `usage.prompt_tokens_details
//! .cached_tokens` (absent counts as 0, as vLLM omits it when nothing was cached):
//!
//! 1. the prompt with salt A, to warm the cache;
//! 2. the same with salt B. No hit: (3) salt A again must hit, and right after it (4) a fresh
//!    salt C must miss too — then the salt is honoured (`salt`). If A does not hit, the engine
//!    showed no hit at all (it reports no cached tokens, or caches nothing), so the miss in (2)
//!    proves nothing (`none`). If C hits, B's miss met a cold cache the prompt had not reached
//!    yet (data-parallel ranks taken in turn, or several engines behind one URL: B warmed it),
//!    and the salt is ignored: on to (3) below.
//! 3. A hit in (2): the salt is ignored. Salt B with the off-switch (`cache_prompt: false`)
//!    must miss, and (4) salt B again without it must still hit — then the switch works
//!    (`cache_off`). A hit with the switch: `none`. A miss both times says nothing (the cache
//!    went away meanwhile): the probe failed.
//!
//! A miss only counts next to a hit measured right after it, so an engine that merely reports
//! nothing is never taken for one that isolates. A probe that fails (an error status, a
//! timeout, an answer without usage, an inconclusive run) leaves the replica `unprobed`, out
//! of rotation, and is retried every [`RETRY_EVERY`].
//!
//! The probe is weir's own traffic: sent straight to the replica (never queued, billed or in
//! the ledger), with random salts (never a tenant's), and a prompt that starts with a random
//! nonce, so it shares no cache block with any tenant's prompt either way.

use std::future::Future;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::config::engine::CacheIsolation;
use crate::isolation::{Gap, Isolation, OFF_SWITCH};
use crate::replica::upstream::Upstream;
use crate::support::answer::{MAX_ANSWER_BYTES, read_bounded};

/// Longest one probe request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// How long after a failed probe the next one starts.
pub const RETRY_EVERY: Duration = Duration::from_secs(2);
/// Filler after the nonce: about 300 tokens with common tokenizers.
const FILLER: &str = "the quick brown fox jumps over the lazy dog while ";
const FILLER_REPEATS: usize = 30;

/// Which of the probe's three salts a request carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Salt {
    A,
    B,
    C,
}

/// One probe request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ask {
    pub salt: Salt,
    /// Whether it carries the engine's off-switch (`cache_prompt: false`).
    pub off_switch: bool,
}

const fn ask(salt: Salt, off_switch: bool) -> Ask {
    Ask { salt, off_switch }
}

#[derive(Debug, PartialEq, Eq)]
pub enum ProbeError {
    /// No answer (connection refused, timeout).
    Unreachable,
    /// An answer with an error status.
    Status(u16),
    /// An answer that is not a chat completion with a usable `usage`.
    Malformed(&'static str),
    /// The cache missed with the off-switch and without it: nothing learned.
    Inconclusive,
}

impl std::fmt::Display for ProbeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProbeError::Unreachable => {
                write!(
                    f,
                    "no answer (connection failed, or none within {REQUEST_TIMEOUT:?})"
                )
            }
            ProbeError::Status(s) => write!(f, "the engine answered {s}"),
            ProbeError::Malformed(what) => write!(f, "unusable answer: {what}"),
            ProbeError::Inconclusive => {
                write!(f, "no cache hit with the off-switch nor without it")
            }
        }
    }
}

/// Decides the mode from the answers to the probe's requests (`ask` sends one and returns its
/// cached tokens), in the order of the module doc.
pub async fn classify<F, Fut>(mut ask_engine: F) -> Result<Isolation, ProbeError>
where
    F: FnMut(Ask) -> Fut,
    Fut: Future<Output = Result<u64, ProbeError>>,
{
    ask_engine(ask(Salt::A, false)).await?;
    if ask_engine(ask(Salt::B, false)).await? == 0 {
        if ask_engine(ask(Salt::A, false)).await? == 0 {
            return Ok(Isolation::Unisolated(Gap::NoHitSeen));
        }
        // B's miss may have met a cache the prompt had not reached (another data-parallel
        // rank, taken in turn): a salt never seen must miss right after A's hit as well.
        if ask_engine(ask(Salt::C, false)).await? == 0 {
            return Ok(Isolation::Salt);
        }
    }
    if ask_engine(ask(Salt::B, true)).await? > 0 {
        return Ok(Isolation::Unisolated(Gap::SaltIgnored));
    }
    if ask_engine(ask(Salt::B, false)).await? > 0 {
        Ok(Isolation::CacheOff)
    } else {
        Err(ProbeError::Inconclusive)
    }
}

/// The cached prompt tokens an answer reports: `usage` is required (without it nothing can be
/// read), `prompt_tokens_details.cached_tokens` absent or null is 0.
pub fn cached_tokens(answer: &Value) -> Result<u64, ProbeError> {
    let usage = answer
        .get("usage")
        .filter(|u| u.is_object())
        .ok_or(ProbeError::Malformed("no usage"))?;
    match usage
        .get("prompt_tokens_details")
        .and_then(|d| d.get("cached_tokens"))
    {
        None | Some(Value::Null) => Ok(0),
        Some(n) => n
            .as_u64()
            .ok_or(ProbeError::Malformed("cached_tokens is not a count")),
    }
}

/// One probe run against one replica: its nonce and salts, fresh per run so no earlier run's
/// cache entries answer for this one.
struct Run<'a> {
    upstream: &'a Upstream,
    url: &'a str,
    model: &'a str,
    nonce: String,
    salts: [String; 3],
}

/// 128 random bits as hex, from the standard library's randomly keyed hasher: unique per
/// run, which is all a probe's nonce and salts need (they guard nothing).
fn random_hex() -> String {
    let state = std::collections::hash_map::RandomState::new();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{:016x}{:016x}",
        state.hash_one((now, 0u8)),
        state.hash_one((now, 1u8))
    )
}

impl Run<'_> {
    fn body(&self, ask: Ask) -> Value {
        let salt = match ask.salt {
            Salt::A => &self.salts[0],
            Salt::B => &self.salts[1],
            Salt::C => &self.salts[2],
        };
        let prompt = format!(
            "weir cache isolation probe {}: {}",
            self.nonce,
            FILLER.repeat(FILLER_REPEATS)
        );
        let mut body = json!({
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 1,
            "stream": false,
            "temperature": 0,
            "cache_salt": salt,
        });
        if ask.off_switch {
            body[OFF_SWITCH] = Value::Bool(false);
        }
        body
    }

    async fn send(&self, ask: Ask) -> Result<u64, ProbeError> {
        let resp = self
            .upstream
            .post(&format!("{}/v1/chat/completions", self.url))
            // Recognisable in the engine's logs as weir's own.
            .header(
                "x-request-id",
                format!("weir-isolation-probe-{}", self.nonce),
            )
            .json(&self.body(ask))
            .timeout(REQUEST_TIMEOUT)
            .send()
            .await
            .map_err(|_| ProbeError::Unreachable)?;
        let status = resp.status();
        if !status.is_success() {
            return Err(ProbeError::Status(status.as_u16()));
        }
        let body = read_bounded(resp, MAX_ANSWER_BYTES)
            .await
            .ok_or(ProbeError::Malformed("too long, or broken off"))?;
        let answer: Value =
            serde_json::from_slice(&body).map_err(|_| ProbeError::Malformed("not JSON"))?;
        cached_tokens(&answer)
    }
}

/// Probes one replica now.
pub async fn probe(upstream: &Upstream, url: &str, model: &str) -> Result<Isolation, ProbeError> {
    let run = Run {
        upstream,
        url,
        model,
        nonce: random_hex(),
        salts: [random_hex(), random_hex(), random_hex()],
    };
    classify(|ask| run.send(ask)).await
}

/// Where a replica's probing stands, between health samples.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Not probed since it joined: probe at the next healthy sample.
    Due,
    Probed,
    /// The last probe failed: the next one starts then.
    RetryAt(Instant),
}

/// Probes a replica when it joins — the first healthy sample after start-up or after being
/// unhealthy — and again after a failure; the health loop calls it after every sample.
pub struct Prober {
    upstream: Arc<Upstream>,
    url: String,
    model: String,
    policy: CacheIsolation,
    state: State,
}

impl Prober {
    pub fn new(
        upstream: Arc<Upstream>,
        url: String,
        model: String,
        policy: CacheIsolation,
    ) -> Prober {
        Prober {
            upstream,
            url,
            model,
            policy,
            state: State::Due,
        }
    }

    /// Probes from now on go through `upstream` (a reload changed the pool's CA or credential);
    /// what was found stands.
    pub fn set_upstream(&mut self, upstream: Arc<Upstream>) {
        self.upstream = upstream;
    }

    /// The replica's new mode after a health sample, when it changed.
    pub async fn after_sample(&mut self, healthy: bool) -> Option<Isolation> {
        if self.policy == CacheIsolation::Shared {
            return None;
        }
        if !healthy {
            // What answers when it is back may be another engine, or the same with other
            // flags: it is probed again before it gets work.
            let was = std::mem::replace(&mut self.state, State::Due);
            return (was == State::Probed).then_some(Isolation::Unprobed);
        }
        match self.state {
            State::Probed => return None,
            State::RetryAt(at) if Instant::now() < at => return None,
            State::Due | State::RetryAt(_) => {}
        }
        match probe(&self.upstream, &self.url, &self.model).await {
            Ok(found) => {
                self.state = State::Probed;
                match found.reason() {
                    Some(reason) => tracing::warn!(
                        replica = %self.url, mode = found.label(), "prefix-cache isolation: {reason}"
                    ),
                    None => tracing::info!(
                        replica = %self.url, mode = found.label(), "prefix-cache isolation probed"
                    ),
                }
                Some(found)
            }
            Err(e) => {
                self.state = State::RetryAt(Instant::now() + RETRY_EVERY);
                tracing::warn!(
                    replica = %self.url,
                    "prefix-cache isolation probe failed ({e}): no traffic until a probe succeeds; retrying in {RETRY_EVERY:?}"
                );
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::collections::HashSet;

    /// A model engine: a prefix cache keyed by the salt when it honours salts, an off-switch
    /// that works or not, cached tokens reported or not.
    #[derive(Default)]
    struct Engine {
        honours_salt: bool,
        honours_off_switch: bool,
        reports: bool,
        /// Empties its cache after the request with this index and caches nothing after.
        empties_after: Option<usize>,
        /// Fails the request with this index (0-based).
        fails_at: Option<usize>,
        /// Data-parallel ranks, each with its own cache, taken in turn (SGLang's default
        /// round-robin with `--dp-size`, or several engines behind one URL); 0 counts as 1.
        ranks: usize,
        cache: RefCell<HashSet<(usize, Option<Salt>)>>,
        asked: RefCell<Vec<Ask>>,
    }

    impl Engine {
        async fn answer(&self, ask: Ask) -> Result<u64, ProbeError> {
            let n = self.asked.borrow().len();
            self.asked.borrow_mut().push(ask);
            if self.fails_at == Some(n) {
                return Err(ProbeError::Status(500));
            }
            let key = (n % self.ranks.max(1), self.honours_salt.then_some(ask.salt));
            let off = ask.off_switch && self.honours_off_switch;
            let hit = !off && self.cache.borrow().contains(&key);
            if self.empties_after.is_some_and(|last| n >= last) {
                self.cache.borrow_mut().clear();
            } else {
                self.cache.borrow_mut().insert(key);
            }
            Ok(if hit && self.reports { 288 } else { 0 })
        }

        async fn classify(&self) -> Result<Isolation, ProbeError> {
            classify(|ask| self.answer(ask)).await
        }
    }

    #[tokio::test]
    async fn vllm_honours_the_salt() {
        let vllm = Engine {
            honours_salt: true,
            reports: true,
            ..Engine::default()
        };
        assert_eq!(vllm.classify().await, Ok(Isolation::Salt));
        assert!(
            !vllm.asked.borrow().iter().any(|a| a.off_switch),
            "no off-switch needed"
        );
    }

    #[tokio::test]
    async fn llama_cpp_ignores_the_salt_and_its_off_switch_works() {
        let llama = Engine {
            honours_off_switch: true,
            reports: true,
            ..Engine::default()
        };
        assert_eq!(llama.classify().await, Ok(Isolation::CacheOff));
        assert_eq!(
            llama.asked.borrow()[2..],
            [ask(Salt::B, true), ask(Salt::B, false)],
            "the switch is tried, then the cache shown to be still warm without it"
        );
    }

    #[tokio::test]
    async fn an_engine_that_ignores_the_salt_and_has_no_off_switch_is_not_isolated() {
        let shared = Engine {
            reports: true,
            ..Engine::default()
        };
        assert_eq!(
            shared.classify().await,
            Ok(Isolation::Unisolated(Gap::SaltIgnored))
        );
    }

    #[tokio::test]
    async fn an_engine_that_reports_no_cached_tokens_is_never_taken_for_isolated() {
        // Whether it honours the salt or not, an engine that reports no cached tokens (vLLM
        // without --enable-prompt-tokens-details, SGLang without --enable-cache-report, TGI)
        // misses every time: its misses prove nothing.
        for honours_salt in [false, true] {
            let silent = Engine {
                honours_salt,
                ..Engine::default()
            };
            assert_eq!(
                silent.classify().await,
                Ok(Isolation::Unisolated(Gap::NoHitSeen))
            );
        }
    }

    #[tokio::test]
    async fn a_miss_on_a_cold_rank_is_not_taken_for_an_honoured_salt() {
        // Two ranks in turn: salt B lands on the cold one and misses, salt A on the warm one
        // and hits, whether the salt is honoured or not.
        let old_sglang = Engine {
            reports: true,
            ranks: 2,
            ..Engine::default()
        };
        assert_eq!(
            old_sglang.classify().await,
            Ok(Isolation::Unisolated(Gap::SaltIgnored))
        );
        let llama = Engine {
            reports: true,
            honours_off_switch: true,
            ranks: 2,
            ..Engine::default()
        };
        assert_eq!(llama.classify().await, Ok(Isolation::CacheOff));
        let vllm = Engine {
            honours_salt: true,
            reports: true,
            ranks: 2,
            ..Engine::default()
        };
        assert_eq!(vllm.classify().await, Ok(Isolation::Salt));
    }

    #[tokio::test]
    async fn a_cache_that_empties_meanwhile_is_inconclusive_not_isolated() {
        // Ignores the salt and the switch alike, but loses its cache right after the hit in
        // step two (evicted under someone else's load): the miss with the switch proves nothing.
        let evicted = Engine {
            reports: true,
            empties_after: Some(1),
            ..Engine::default()
        };
        assert_eq!(evicted.classify().await, Err(ProbeError::Inconclusive));
    }

    #[tokio::test]
    async fn an_engine_error_at_any_step_fails_the_probe() {
        for step in 0..4 {
            let llama = Engine {
                honours_off_switch: true,
                reports: true,
                fails_at: Some(step),
                ..Engine::default()
            };
            assert_eq!(
                llama.classify().await,
                Err(ProbeError::Status(500)),
                "step {step}"
            );
        }
    }

    #[test]
    fn cached_tokens_are_read_as_the_engines_report_them() {
        // llama.cpp (chat-same-prompt-other-salt.json): the other salt hit the cache.
        let llama = json!({"object": "chat.completion", "usage": {"completion_tokens": 6,
            "prompt_tokens": 33, "total_tokens": 39, "prompt_tokens_details": {"cached_tokens": 32}},
            "timings": {"cache_n": 32}});
        assert_eq!(cached_tokens(&llama), Ok(32));
        // vLLM omits the details when nothing was cached (and without
        // --enable-prompt-tokens-details).
        let vllm =
            json!({"usage": {"prompt_tokens": 16, "total_tokens": 17, "completion_tokens": 1}});
        assert_eq!(cached_tokens(&vllm), Ok(0));
        let null = json!({"usage": {"prompt_tokens": 5, "prompt_tokens_details": null}});
        assert_eq!(cached_tokens(&null), Ok(0));
        for bad in [
            json!({"choices": []}),
            json!({"usage": null}),
            json!({"usage": {"prompt_tokens_details": {"cached_tokens": "32"}}}),
            json!({"usage": {"prompt_tokens_details": {"cached_tokens": -1}}}),
            json!([1, 2]),
        ] {
            assert!(cached_tokens(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn probe_requests_are_short_unstreamed_and_carry_weirs_own_salts() {
        let upstream = Upstream::plain();
        let run = Run {
            upstream: &upstream,
            url: "http://r",
            model: "m",
            nonce: random_hex(),
            salts: [random_hex(), random_hex(), random_hex()],
        };
        assert_ne!(run.salts[0], run.salts[1]);
        assert_ne!(run.salts[1], run.salts[2]);
        let a = run.body(ask(Salt::A, false));
        let b = run.body(ask(Salt::B, true));
        assert_eq!(
            (a["max_tokens"].as_u64(), a["stream"].as_bool()),
            (Some(1), Some(false))
        );
        assert_eq!(a["messages"], b["messages"], "one prompt");
        assert_ne!(a["cache_salt"], b["cache_salt"]);
        assert!(a.get(OFF_SWITCH).is_none());
        assert_eq!(b[OFF_SWITCH], false);
        let prompt = a["messages"][0]["content"].as_str().unwrap_or_default();
        assert!(prompt.contains(&run.nonce), "starts with the run's nonce");
        assert!(
            prompt.split_whitespace().count() > 256,
            "several cache blocks"
        );
    }

    #[tokio::test]
    async fn a_replica_is_probed_when_it_joins_and_again_when_it_comes_back() {
        // Nothing listens on port 9 of loopback: every probe fails fast.
        let mut prober = Prober::new(
            Upstream::plain(),
            "http://127.0.0.1:9".into(),
            "m".into(),
            CacheIsolation::Probe,
        );
        assert_eq!(
            prober.after_sample(true).await,
            None,
            "failed: still unprobed"
        );
        assert!(matches!(prober.state, State::RetryAt(_)));
        prober.state = State::Probed;
        assert_eq!(
            prober.after_sample(true).await,
            None,
            "probed once per join"
        );
        assert_eq!(
            prober.after_sample(false).await,
            Some(Isolation::Unprobed),
            "unhealthy: the mode is forgotten"
        );
        assert_eq!(prober.state, State::Due);
        assert_eq!(prober.after_sample(false).await, None);

        let mut shared = Prober::new(
            Upstream::plain(),
            "http://127.0.0.1:9".into(),
            "m".into(),
            CacheIsolation::Shared,
        );
        assert_eq!(shared.after_sample(true).await, None, "never probed");
        assert_eq!(shared.after_sample(false).await, None);
    }
}
