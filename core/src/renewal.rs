//! The background renewal of fleet-wide leases, host-free: who renews, what one renewal asks
//! for, and what its answer does.
//!
//! Every worker VM of an Envoy ticks, but one renewal per Envoy per period is sent: a worker
//! claims the period through a shared-data record (`weir:fleet:renewer`: holder, when its call
//! started, when the next is due) by compare-and-swap, so N workers never send N calls; a
//! holder whose call never finished (its VM was replaced) is taken over once the call's timeout
//! has passed. The renewal carries every counter in the active set (`weir:fleet:active`, the
//! counters requests touched, kept so no worker scans every tenant): those whose lease runs low
//! or that a request found short ask for tokens, lapsed leases give theirs back. The answer's
//! grants are added to each counter's lease; a failed call marks the store down
//! ([`crate::allowance::HEALTH_KEY`]) and the first answer marks it up again.

use std::collections::HashMap;

use crate::active_set::{active, delist, enlist};
use crate::allowance::{self, Allowance, Ask};
use crate::config::Tenant;
use crate::fleet::{CounterAsk, Holder, LeaseRequest, LeaseResponse, MAX_COUNTERS, Window};
use crate::reservation::{self, Fleet};
use crate::store::{SharedStore, Update, update};

/// Shared-data key of the renewal claim.
pub const CLAIM_KEY: &str = "weir:fleet:renewer";

/// What the renewal knows of each fleet-wide counter, from the configuration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spec {
    pub limit: u64,
    pub fleet: Fleet,
}

impl Spec {
    fn context(&self, store_down: bool) -> allowance::Context {
        allowance::Context {
            limit: self.limit,
            window: self.fleet.window,
            fail: self.fleet.fail,
            terms: self.fleet.terms,
            store_down,
        }
    }
}

/// The renewal's terms for every fleet-wide counter of `tenants`, by counter key.
pub fn specs<'a>(tenants: impl IntoIterator<Item = &'a Tenant>) -> HashMap<String, Spec> {
    tenants
        .into_iter()
        .flat_map(reservation::fleet_counters)
        .map(|(key, limit, fleet)| (key, Spec { limit, fleet }))
        .collect()
}

/// The claim record: 24 bytes, holder id, call started (0: none in flight), next due.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Claim {
    holder: u64,
    started_ms: u64,
    due_ms: u64,
}

impl Claim {
    fn decode(bytes: &[u8]) -> Option<Claim> {
        let field = |i: usize| -> Option<u64> {
            Some(u64::from_le_bytes(
                bytes.get(i * 8..i * 8 + 8)?.try_into().ok()?,
            ))
        };
        Some(Claim {
            holder: field(0)?,
            started_ms: field(1)?,
            due_ms: field(2)?,
        })
    }

    fn encode(&self) -> Vec<u8> {
        [self.holder, self.started_ms, self.due_ms]
            .iter()
            .flat_map(|f| f.to_le_bytes())
            .collect()
    }
}

/// Claims this period's renewal for `holder`, if one is due and no other call is in flight
/// (or the one in flight is past `timeout_ms`: its holder is gone).
pub fn claim(
    store: &impl SharedStore,
    holder: u64,
    now_ms: u64,
    renew_ms: u64,
    timeout_ms: u64,
) -> bool {
    let won = update(store, CLAIM_KEY, |current| {
        let c = current.and_then(Claim::decode).unwrap_or_default();
        let in_flight = c.started_ms != 0 && now_ms < c.started_ms.saturating_add(timeout_ms);
        if now_ms < c.due_ms || in_flight {
            return Err(());
        }
        Ok(Claim {
            holder,
            started_ms: now_ms,
            due_ms: now_ms.saturating_add(renew_ms),
        }
        .encode())
    });
    matches!(won, Update::Done(()))
}

/// Ends `holder`'s call (answered, failed or not needed); the next is due as claimed.
pub fn release(store: &impl SharedStore, holder: u64) {
    let _ = update(store, CLAIM_KEY, |current| {
        let c = current.and_then(Claim::decode).unwrap_or_default();
        if c.holder != holder {
            return Err(());
        }
        Ok(Claim { started_ms: 0, ..c }.encode())
    });
}

/// Takes an idle counter out of the active set: out of the set first, then its mark cleared
/// unless a request touched it meanwhile (it would re-list itself only if unmarked).
fn retire(store: &impl SharedStore, key: &str) {
    delist(store, key);
    let touched = update(store, key, |current| {
        let mut a = current.and_then(Allowance::decode).ok_or(())?;
        if a.tokens != 0.0 || a.spent != 0.0 || a.wanted != 0.0 {
            return Err(());
        }
        a.listed = false;
        Ok(a.encode())
    });
    if !matches!(touched, Update::Done(())) {
        enlist(store, key);
    }
}

/// The renewal to send now: one ask per active counter that needs tokens or gives some back.
/// Lapsed tokens leave their lease here (they travel in the ask); idle counters leave the set.
pub fn plan(store: &impl SharedStore, specs: &HashMap<String, Spec>, now_ms: u64) -> LeaseRequest {
    let mut counters = Vec::new();
    for key in active(store) {
        let Some(spec) = specs.get(&key) else {
            // A counter of an earlier configuration.
            delist(store, &key);
            continue;
        };
        match ask(store, &key, spec, now_ms) {
            Asked::Idle => retire(store, &key),
            Asked::Ask(ask) => counters.push(ask),
            Asked::Nothing => {}
        }
        if counters.len() >= MAX_COUNTERS {
            break;
        }
    }
    LeaseRequest {
        counters,
        holder: None,
    }
}

/// The renewal to send at once for a request that found no lease ([`Denial::Unleased`]):
/// for each of `specs` (its tenant's fleet-wide counters) that requests found short or that
/// owe, what they found missing and what is owed — no more, so concurrent first requests on one Envoy ask for what they spend
/// between them, not a lease each — and the tokens of a lapsed lease given back.
///
/// [`Denial::Unleased`]: crate::reservation::Denial::Unleased
pub fn plan_for(
    store: &impl SharedStore,
    specs: &HashMap<String, Spec>,
    now_ms: u64,
) -> LeaseRequest {
    let mut counters = Vec::new();
    for (key, spec) in specs {
        let ctx = spec.context(false);
        let mut asked = Ask::default();
        let updated = update::<()>(store, key, |current| {
            let a = current.and_then(Allowance::decode).ok_or(())?;
            if a.wanted <= 0.0 && a.tokens >= 0.0 {
                return Err(());
            }
            let (next, ask) = a.ask_now(&ctx, now_ms);
            asked = ask;
            Ok(next.encode())
        });
        if matches!(updated, Update::Done(())) && (asked.want > 0 || asked.returned > 0) {
            counters.push(counter_ask(key, spec, asked));
        }
        if counters.len() >= MAX_COUNTERS {
            break;
        }
    }
    LeaseRequest {
        counters,
        holder: None,
    }
}

/// A counter's ask as the quota service takes it.
fn counter_ask(key: &str, spec: &Spec, ask: Ask) -> CounterAsk {
    let window = spec.fleet.window;
    CounterAsk {
        key: key.to_owned(),
        window,
        limit: spec.limit,
        want: ask.want,
        returned: ask.returned,
        returned_window_start_ms: ask.returned_window_start_ms,
        held: (window != Window::Minute).then_some(ask.held),
        held_window_start_ms: ask.held_window_start_ms,
    }
}

/// What one counter's lease asks of the store now ([`Allowance::ask`]).
enum Asked {
    Ask(CounterAsk),
    /// Nothing to ask or give back, and the counter is idle.
    Idle,
    /// Nothing this time (or its lease kept changing under us).
    Nothing,
}

fn ask(store: &impl SharedStore, key: &str, spec: &Spec, now_ms: u64) -> Asked {
    let ctx = spec.context(false);
    let mut asked = None;
    let updated = update::<()>(store, key, |current| {
        let a = current
            .and_then(Allowance::decode)
            .unwrap_or_else(|| Allowance::cold(&ctx, now_ms));
        let (next, ask) = a.ask(&ctx, now_ms);
        asked = ask;
        Ok(next.encode())
    });
    if !matches!(updated, Update::Done(())) {
        return Asked::Nothing;
    }
    match asked {
        None => Asked::Idle,
        // A window's holding is reported when it changed and every `report_ms` while it lasts:
        // the store takes back the holding of an Envoy that stops reporting.
        Some(ask) if ask.want > 0 || ask.returned > 0 || ask.report => {
            Asked::Ask(counter_ask(key, spec, ask))
        }
        Some(_) => Asked::Nothing,
    }
}

/// Shared-data key of this Envoy's holder id ([`Holder`]): every VM of one Envoy sends it.
pub const HOLDER_KEY: &str = "weir:fleet:holder";

/// Names this Envoy as a holder of leases, once: the first of its VMs to start writes `id`
/// (fresh random hex), later ones and reloads keep it, so all its calls carry one id. It is
/// named before any request, so no call goes out under an id another VM then replaces.
pub fn name_holder(store: &impl SharedStore, id: &str) {
    let _ = update::<()>(store, HOLDER_KEY, |current| match current {
        Some(named) if !named.is_empty() => Err(()),
        _ => Ok(id.as_bytes().to_vec()),
    });
}

/// This Envoy as a renewal names it: its id, and how long its holdings stand without a call.
pub fn holder(store: &impl SharedStore, hold_ms: u64) -> Option<Holder> {
    let (id, _) = store.load(HOLDER_KEY)?;
    let id = String::from_utf8(id).ok().filter(|id| !id.is_empty())?;
    Some(Holder { id, hold_ms })
}

/// Adds the answer's grants to their leases and marks the store up.
pub fn apply(
    store: &impl SharedStore,
    specs: &HashMap<String, Spec>,
    response: &LeaseResponse,
    now_ms: u64,
) {
    for grant in &response.grants {
        let Some(spec) = specs.get(&grant.key) else {
            continue;
        };
        let ctx = spec.context(false);
        let _ = update::<()>(store, &grant.key, |current| {
            let a = current
                .and_then(Allowance::decode)
                .unwrap_or_else(|| Allowance::cold(&ctx, now_ms));
            Ok(a.add_grant(grant, &ctx, now_ms).encode())
        });
    }
    set_health(store, None);
}

/// Marks the store down (a failed or timed-out renewal, a 503): since the first failure.
pub fn mark_down(store: &impl SharedStore, now_ms: u64) {
    let since = store
        .load(allowance::HEALTH_KEY)
        .and_then(|(v, _)| allowance::down_since(Some(&v)))
        .unwrap_or(now_ms);
    set_health(store, Some(since));
}

fn set_health(store: &impl SharedStore, down_since_ms: Option<u64>) {
    let _ = store.store(
        allowance::HEALTH_KEY,
        &allowance::health(down_since_ms),
        None,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::active_set::ACTIVE_KEY;
    use crate::config::Config;
    use crate::fleet::Grant;
    use crate::reservation::tests::Memory;
    use crate::reservation::{self, Demand, Denial, Ledger, SlotLease};

    fn config(fail: &str) -> Config {
        org_config(&format!(
            r#""input_tokens_per_minute":60000,"fleet_wide":{{"input_tokens_per_minute":"{fail}"}}"#
        ))
    }

    /// Org `acme` with the `limits` fields given, one key under it.
    fn org_config(limits: &str) -> Config {
        let json = format!(
            r#"{{"signing":{{"secret_env":"S"}},"fleet":{{"cluster":"quota"}},
            "orgs":[{{"id":"acme","limits":{{{limits}}},
            "workspaces":[{{"id":"w","projects":[{{"id":"p","keys":[
            {{"id":"k","sha256":"{h}"}}]}}]}}]}}]}}"#,
            h = "a".repeat(64)
        );
        Config::parse(json.as_bytes()).unwrap()
    }

    fn specs_of(config: &Config) -> HashMap<String, Spec> {
        specs(config.directory().tenants())
    }

    const SLOT: SlotLease = SlotLease {
        id: 1,
        ttl_ms: 30_000,
    };
    const KEY: &str = "weir:e:acme:itpm";

    fn demand(n: u64) -> Demand {
        Demand {
            input_tokens: n,
            output_tokens: 0,
            cost_micros: 0,
        }
    }

    /// Org `acme` with one `budget` (and the top-level fields `extra`, each ending in `,`).
    fn budget_config(extra: &str, budget: &str) -> Config {
        let json = format!(
            r#"{{"signing":{{"secret_env":"S"}},"fleet":{{"cluster":"quota"}},{extra}
            "orgs":[{{"id":"acme","limits":{{"budgets":[{budget}]}},
            "workspaces":[{{"id":"w","projects":[{{"id":"p","keys":[
            {{"id":"k","sha256":"{h}"}}]}}]}}]}}]}}"#,
            h = "a".repeat(64)
        );
        Config::parse(json.as_bytes()).unwrap()
    }

    /// As the filter charges a request at its headers: nothing yet, its slot held.
    fn at_headers(
        store: &Memory,
        tenant: &crate::config::Tenant,
        now: u64,
    ) -> reservation::Reservation {
        reservation::reserve(store, tenant, Demand::default(), Ledger::Enforce, SLOT, now).unwrap()
    }

    fn grant_all(request: &LeaseRequest) -> LeaseResponse {
        LeaseResponse {
            grants: request
                .counters
                .iter()
                .map(|c| Grant {
                    key: c.key.clone(),
                    granted: c.want,
                    remaining: 50_000,
                    resets_ms: 0,
                    window_start_ms: None,
                })
                .collect(),
        }
    }

    #[test]
    fn one_worker_claims_a_period_and_a_dead_holder_is_taken_over() {
        let store = Memory::default();
        let t = 10_000;
        assert!(claim(&store, 1, t, 250, 1_000));
        assert!(!claim(&store, 2, t, 250, 1_000), "same period");
        assert!(
            !claim(&store, 2, t + 300, 250, 1_000),
            "due, but 1's call is in flight"
        );
        release(&store, 1);
        assert!(claim(&store, 2, t + 300, 250, 1_000));
        // 2's VM dies with its call in flight: after the timeout another worker takes over.
        assert!(!claim(&store, 3, t + 1_200, 250, 1_000));
        assert!(claim(&store, 3, t + 1_300, 250, 1_000));
        release(&store, 2);
        assert!(
            !claim(&store, 1, t + 1_600, 250, 1_000),
            "a stale holder's release is ignored"
        );
    }

    #[test]
    fn a_cold_counter_is_unleased_at_its_first_request_and_served_after_its_own_ask() {
        let config = config("fail_closed");
        let specs = specs_of(&config);
        let tenant = config.directory().tenants().next().unwrap().clone();
        let store = Memory::default();
        reservation::initialize(&store, [&tenant], 0);
        let refused = reservation::reserve(&store, &tenant, demand(500), Ledger::Enforce, SLOT, 0);
        assert!(
            matches!(
                refused,
                Err(Denial::Unleased {
                    remaining: 0,
                    retry_after_ms: 250,
                    ..
                })
            ),
            "{refused:?}"
        );
        // The request asks at once for what it found missing at its tenant's counters.
        let ask = plan_for(&store, &specs, 10);
        assert_eq!(ask.counters.len(), 1, "one counter, one call");
        assert_eq!(
            (ask.counters[0].key.as_str(), ask.counters[0].want),
            (KEY, 500)
        );
        apply(&store, &specs, &grant_all(&ask), 20);
        let r = reservation::reserve(&store, &tenant, demand(500), Ledger::Enforce, SLOT, 30);
        let r = r.unwrap();
        // Settling a smaller use refunds the lease.
        reservation::settle(&store, &r, demand(300), 40);
        let a = Allowance::decode(&store.load(KEY).unwrap().0).unwrap();
        assert_eq!(a.tokens, 200.0);
    }

    #[test]
    fn a_first_request_asks_at_once_for_every_counter_it_lacks_and_its_count_is_owed() {
        // Fleet-wide requests and input tokens at the org, input tokens at the key: a cold
        // Envoy. The headers' charge takes the request count as a debt (its slot held); the
        // body's tokens find no lease at two counters, and one ask covers both.
        let json = format!(
            r#"{{"signing":{{"secret_env":"S"}},"fleet":{{"cluster":"quota"}},
            "orgs":[{{"id":"acme","limits":{{"requests_per_minute":100,
            "input_tokens_per_minute":60000,"fleet_wide":{{"requests_per_minute":"fail_closed",
            "input_tokens_per_minute":"fail_closed"}}}},
            "workspaces":[{{"id":"w","projects":[{{"id":"p","keys":[
            {{"id":"k","sha256":"{h}","limits":{{"input_tokens_per_minute":6000,
            "fleet_wide":{{"input_tokens_per_minute":"fail_open"}}}}}}]}}]}}]}}]}}"#,
            h = "a".repeat(64)
        );
        let config = Config::parse(json.as_bytes()).unwrap();
        let specs = specs_of(&config);
        let tenant = config.directory().tenants().next().unwrap().clone();
        let store = Memory::default();
        reservation::initialize(&store, [&tenant], 0);
        let mut r = at_headers(&store, &tenant, 0);
        let owed = Allowance::decode(&store.load("weir:e:acme:rpm").unwrap().0).unwrap();
        assert_eq!(owed.tokens, -1.0, "the request's count is owed");
        let refused = reservation::extend(&store, &mut r, demand(500), 1);
        assert!(
            matches!(refused, Err(Denial::Unleased { .. })),
            "{refused:?}"
        );
        let ask = plan_for(&store, &specs, 2);
        let mut wants: Vec<(&str, u64)> = (ask.counters.iter())
            .map(|c| (c.key.as_str(), c.want))
            .collect();
        wants.sort();
        assert_eq!(
            wants,
            [
                ("weir:e:acme/w/p/k:itpm", 500),
                ("weir:e:acme:itpm", 500),
                ("weir:e:acme:rpm", 1),
            ]
        );
        apply(&store, &specs, &grant_all(&ask), 3);
        reservation::extend(&store, &mut r, demand(500), 4).unwrap();
    }

    #[test]
    fn a_counter_that_finds_the_active_set_full_is_listed_once_there_is_room() {
        let config = config("fail_closed");
        let specs = specs_of(&config);
        let tenant = config.directory().tenants().next().unwrap().clone();
        let store = Memory::default();
        // Another tenant's counters fill the active set.
        let others: Vec<String> = (0..MAX_COUNTERS)
            .map(|i| format!("weir:e:other{i}:rpm"))
            .collect();
        store
            .store(ACTIVE_KEY, others.join("\n").as_bytes(), None)
            .unwrap();
        let r = reservation::reserve(&store, &tenant, demand(100), Ledger::Enforce, SLOT, 0);
        assert!(r.is_err(), "cold: {r:?}");
        assert!(!active(&store).contains(&KEY.to_owned()), "no room yet");
        // The other counters leave (they are not in this configuration); there is room now.
        let _ = plan(&store, &specs, 100);
        let r = reservation::reserve(&store, &tenant, demand(100), Ledger::Enforce, SLOT, 200);
        assert!(r.is_err(), "still cold: {r:?}");
        let ask = plan(&store, &specs, 300);
        println!("asks once there is room: {}", ask.counters.len());
        assert_eq!(ask.counters.len(), 1, "the counter is renewed: {ask:?}");
    }

    #[test]
    fn a_refund_of_a_request_served_from_the_fail_open_share_never_becomes_store_tokens() {
        let config = config("fail_open");
        let specs = specs_of(&config);
        let tenant = config.directory().tenants().next().unwrap().clone();
        let store = Memory::default();
        mark_down(&store, 0);
        // 5,000 of the 6,000-token share reserved, none used (a refusal, a short answer).
        let r = reservation::reserve(&store, &tenant, demand(5_000), Ledger::Enforce, SLOT, 10);
        reservation::settle(&store, &r.unwrap(), demand(0), 20);
        let a = Allowance::decode(&store.load(KEY).unwrap().0).unwrap();
        println!("lease tokens after the refund: {}", a.tokens);
        assert_eq!(a.tokens, 0.0, "the store granted nothing");
        // The refund went back to the share: the whole share is there again, and no more.
        let again = reservation::reserve(&store, &tenant, demand(6_000), Ledger::Enforce, SLOT, 30);
        assert!(again.is_ok(), "{again:?}");
        let over = reservation::reserve(&store, &tenant, demand(1), Ledger::Enforce, SLOT, 30);
        assert!(over.is_err(), "over the local share");
        let ask = plan(&store, &specs, 300);
        let returned: u64 = ask.counters.iter().map(|c| c.returned).sum();
        println!("returned to the store: {returned}");
        assert_eq!(
            returned, 0,
            "tokens the store never granted are not given back"
        );
    }

    #[test]
    fn a_store_down_fails_closed_or_open_and_the_first_answer_recovers() {
        for fail in ["fail_closed", "fail_open"] {
            let config = config(fail);
            let specs = specs_of(&config);
            let tenant = config.directory().tenants().next().unwrap().clone();
            let store = Memory::default();
            let _ = reservation::reserve(&store, &tenant, demand(100), Ledger::Enforce, SLOT, 0);
            mark_down(&store, 5);
            mark_down(&store, 9);
            let health = store.load(allowance::HEALTH_KEY).map(|(v, _)| v);
            assert_eq!(allowance::down_since(health.as_deref()), Some(5));
            let r = reservation::reserve(&store, &tenant, demand(100), Ledger::Enforce, SLOT, 10);
            match fail {
                "fail_closed" => {
                    assert!(matches!(r, Err(Denial::QuotaUnavailable { .. })), "{r:?}")
                }
                // 10% of 60,000 per minute on this Envoy alone.
                _ => {
                    assert!(r.is_ok(), "{r:?}");
                    let big = reservation::reserve(
                        &store,
                        &tenant,
                        demand(6_000),
                        Ledger::Enforce,
                        SLOT,
                        10,
                    );
                    assert!(big.is_err(), "over the local share");
                }
            }
            let ask = plan(&store, &specs, 300);
            apply(&store, &specs, &grant_all(&ask), 310);
            let health = store.load(allowance::HEALTH_KEY).map(|(v, _)| v);
            assert!(!allowance::store_down(health.as_deref()));
            let r = reservation::reserve(&store, &tenant, demand(100), Ledger::Enforce, SLOT, 320);
            assert!(r.is_ok(), "{fail}: {r:?}");
        }
    }

    #[test]
    fn a_monthly_spend_budget_is_reserved_at_cost_and_refused_until_the_first_of_next_month() {
        let config = budget_config(
            r#""prices":{"currency":"USD","default":{"input":1.0,"output":2.0}},"#,
            r#"{"window":"month","spend":0.01}"#,
        );
        let specs = specs_of(&config);
        let key = "weir:e:acme:month:spend";
        assert_eq!(
            specs.get(key).map(|s| s.limit),
            Some(10_000),
            "1 cent in micro-units"
        );
        let tenant = config.directory().tenants().next().unwrap().clone();
        let store = Memory::default();
        // 2026-12-02: the month ends 2027-01-01T00:00:00Z.
        let now = 1_796_183_000_000;
        let (start, end) = crate::fleet::Window::Month.bounds(now).unwrap();
        // 2,000 input tokens at $1/M and 1,000 output at $2/M: 4,000 micro-dollars.
        let cost = Demand {
            input_tokens: 2_000,
            output_tokens: 1_000,
            cost_micros: 4_000,
        };
        let _ = reservation::reserve(&store, &tenant, cost, Ledger::Enforce, SLOT, now);
        let ask = plan(&store, &specs, now);
        assert_eq!(ask.counters[0].window, crate::fleet::Window::Month);
        // The store has 6,000 micro-dollars left of the month's 10,000 (another Envoy spent some).
        let grant = Grant {
            key: key.into(),
            granted: 6_000,
            remaining: 0,
            resets_ms: end,
            window_start_ms: Some(start),
        };
        let response = LeaseResponse {
            grants: vec![grant],
        };
        apply(&store, &specs, &response, now);
        // As the filter charges: the request at its headers, its cost once the body is read.
        let mut r = at_headers(&store, &tenant, now);
        reservation::extend(&store, &mut r, cost, now).unwrap();
        // It used less: 1,000 micro-dollars come back to the lease.
        let used = Demand {
            cost_micros: 3_000,
            ..cost
        };
        reservation::settle(&store, &r, used, now);
        let lease = Allowance::decode(&store.load(key).unwrap().0).unwrap();
        assert_eq!(lease.tokens, 3_000.0, "charged what it used, once");
        let refused = reservation::reserve(&store, &tenant, cost, Ledger::Enforce, SLOT, now);
        let Err(denial) = refused else {
            panic!("3,000 left of a 4,000 cost: {refused:?}")
        };
        assert!(matches!(denial, Denial::BudgetExceeded { resets_ms, .. } if resets_ms == end));
        let reply = crate::reply::Reply::denied(&denial, crate::error::ErrorShape::OpenAi, now);
        let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(reply.status, 429);
        assert_eq!(body["error"]["type"], "insufficient_quota");
        assert_eq!(body["error"]["code"], "budget_exceeded");
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("month spend budget of 0.01 on acme")
                && message.contains("2027-01-01T00:00:00Z"),
            "{message}"
        );
        let header = |name: &str| {
            reply
                .headers
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(
            header("retry-after"),
            Some(((end - now) / 1_000).to_string())
        );
        assert!(header(crate::reply::BUDGET_HEADER).is_some_and(|h| h.contains("window=month")));
    }

    #[test]
    fn a_request_charged_before_the_first_grant_settles_against_the_lease_its_body_took() {
        let config = budget_config("", r#"{"window":"month","tokens":100000}"#);
        let specs = specs_of(&config);
        let key = "weir:e:acme:month:tokens";
        let tenant = config.directory().tenants().next().unwrap().clone();
        let store = Memory::default();
        let now = 1_796_183_000_000;
        let (start, end) = crate::fleet::Window::Month.bounds(now).unwrap();
        // The headers arrive before this Envoy holds a lease for the month.
        let mut r = at_headers(&store, &tenant, now);
        let grant = Grant {
            key: key.into(),
            granted: 5_000,
            remaining: 50_000,
            resets_ms: end,
            window_start_ms: Some(start),
        };
        let _ = plan(&store, &specs, now);
        apply(
            &store,
            &specs,
            &LeaseResponse {
                grants: vec![grant],
            },
            now,
        );
        // The body is read once the lease is here: 1,000 tokens from it; the answer used 3,000.
        reservation::extend(&store, &mut r, demand(1_000), now).unwrap();
        reservation::settle(&store, &r, demand(3_000), now);
        let lease = Allowance::decode(&store.load(key).unwrap().0).unwrap();
        assert_eq!(lease.tokens, 2_000.0, "the overrun is charged to the lease");
    }

    #[test]
    fn a_burst_owes_a_fleet_request_count_only_within_a_lease_s_worth() {
        // Found by the attacker pass: a live lease short of a request count (the store holding
        // plenty) let every request owe its count until the next renewal, unbounded: 1,000
        // requests in one millisecond of a 100-per-minute limit.
        let config = org_config(
            r#""requests_per_minute":100,"fleet_wide":{"requests_per_minute":"fail_closed"}"#,
        );
        let specs = specs_of(&config);
        let tenant = config.directory().tenants().next().unwrap().clone();
        let store = Memory::default();
        reservation::initialize(&store, [&tenant], 0);
        let _first = at_headers(&store, &tenant, 0);
        let ask = plan_for(&store, &specs, 1);
        apply(&store, &specs, &grant_all(&ask), 2);
        let served = (0..1_000)
            .filter(|_| {
                reservation::reserve(&store, &tenant, Demand::default(), Ledger::Enforce, SLOT, 3)
                    .is_ok()
            })
            .count();
        // The lease's one request and at most a tenth of the limit owed (max_lease_fraction).
        assert!(
            served <= 11,
            "served {served} of a 100-per-minute limit at once"
        );
        assert!(served >= 1, "the lease's request is served");
    }

    #[test]
    fn concurrent_first_requests_of_a_small_fleet_request_limit_are_served() {
        // The bound on owed counts must not refuse a few first requests at once on a cold
        // Envoy: with 10 a minute, a tenth of the limit was one, and the second got a 429
        // "remaining 0" (found by the second attacker pass).
        let config = org_config(
            r#""requests_per_minute":10,"fleet_wide":{"requests_per_minute":"fail_closed"}"#,
        );
        let tenant = config.directory().tenants().next().unwrap().clone();
        let store = Memory::default();
        reservation::initialize(&store, [&tenant], 0);
        let served = (0..10)
            .filter(|_| {
                reservation::reserve(&store, &tenant, Demand::default(), Ledger::Enforce, SLOT, 0)
                    .is_ok()
            })
            .count();
        assert_eq!(served, 8, "a few at once, never the whole burst");
    }

    #[test]
    fn a_window_s_holding_is_reported_when_it_changes_and_every_report_ms() {
        // The store takes back what an Envoy holds of a window once it stops hearing from it,
        // so a holding Envoy says so when the holding changed and every `report_ms` (2 s with
        // the default terms) even when it needs nothing; not every period (each report costs
        // the store a look at every holder).
        let monthly = budget_config("", r#"{"window":"month","tokens":100000}"#);
        let specs = specs_of(&monthly);
        let key = "weir:e:acme:month:tokens";
        let tenant = monthly.directory().tenants().next().unwrap().clone();
        let store = Memory::default();
        let now = 1_796_183_000_000;
        let (start, end) = crate::fleet::Window::Month.bounds(now).unwrap();
        let mut r = at_headers(&store, &tenant, now);
        let _ = plan(&store, &specs, now);
        let grant = Grant {
            key: key.into(),
            granted: 5_000,
            remaining: 95_000,
            resets_ms: end,
            window_start_ms: Some(start),
        };
        let granted = LeaseResponse {
            grants: vec![grant],
        };
        apply(&store, &specs, &granted, now);
        reservation::extend(&store, &mut r, demand(1_000), now).unwrap();
        let reported: Vec<_> = (1..=8)
            .map(|period| {
                let ask = plan(&store, &specs, now + period * 250);
                let held: Vec<_> = (ask.counters.iter())
                    .map(|c| (c.want, c.held, c.held_window_start_ms))
                    .collect();
                (period, held)
            })
            .filter(|(_, held)| !held.is_empty())
            .collect();
        let report = vec![(0, Some(4_000), Some(start))];
        assert_eq!(
            reported,
            [(1, report.clone()), (8, report)],
            "after the spend, then at the tick of report_ms (now is a multiple of 2 s)"
        );
        // A per-minute counter's bucket refills whatever a stopped Envoy held: never reported.
        let per_minute = config("fail_closed");
        let specs = specs_of(&per_minute);
        let tenant = per_minute.directory().tenants().next().unwrap().clone();
        let store = Memory::default();
        reservation::initialize(&store, [&tenant], 0);
        let _ = reservation::reserve(&store, &tenant, demand(500), Ledger::Enforce, SLOT, 0);
        let ask = plan_for(&store, &specs, 10);
        apply(&store, &specs, &grant_all(&ask), 20);
        let later = plan(&store, &specs, 300);
        let held = ask
            .counters
            .iter()
            .chain(&later.counters)
            .find_map(|c| c.held);
        assert_eq!(held, None);
    }

    #[test]
    fn counters_not_in_the_config_or_idle_leave_the_active_set() {
        let config = config("fail_closed");
        let specs = specs_of(&config);
        let store = Memory::default();
        enlist(&store, "weir:e:gone:rpm");
        enlist(&store, KEY);
        enlist(&store, KEY);
        assert_eq!(
            active(&store),
            vec!["weir:e:gone:rpm".to_owned(), KEY.to_owned()]
        );
        let ask = plan(&store, &specs, 0);
        assert!(ask.counters.is_empty(), "nothing spent, nothing wanted");
        assert!(active(&store).is_empty());
    }
}
