//! Bounded queues and projected waits: who is refused, and the wait each refusal tells.

use super::*;

#[test]
fn bounded_queues_and_free_tier_shedding() {
    // The pool is full (shedding is for requests that must wait).
    let (mut d, _events, _hog) = saturated(8, 1.0);
    let mut held = Vec::new();
    for _ in 0..4 {
        let (j, rx) = job("busy", "standard", 2_000);
        d.apply(Event::Enqueue(j));
        held.push(rx);
    }
    assert!(
        matches!(held[3].try_recv(), Ok(Err(Refusal::QueueFull(_)))),
        "3 per tenant"
    );
    let (j, mut rx) = job("other", "standard", 2_000);
    d.apply(Event::Enqueue(j));
    held.push(rx);
    // A free-tier tenant's first request queues (its own demand is one request); its
    // next is shed.
    let (free, mut first_rx) = job("cheap", "free", 10);
    d.apply(Event::Enqueue(free));
    assert!(first_rx.try_recv().is_err(), "nothing of its own queued");
    let (free, mut free_rx) = job("cheap", "free", 10);
    d.apply(Event::Enqueue(free));
    assert!(
        matches!(free_rx.try_recv(), Ok(Err(Refusal::Shed(_)))),
        "5 of 8 queued, one its own: shed free tier"
    );
    rx = held.pop().unwrap();
    assert!(rx.try_recv().is_err(), "standard tier still queues");
}

#[test]
fn an_org_cannot_fill_the_queue_by_minting_keys() {
    let (mut d, _events) = dispatcher(100);
    let mut held = Vec::new();
    // Queue from many keys of one org (3 per key would allow all 8): 5 per org.
    for i in 0..8 {
        let (j, rx) = job(&format!("org/w/p/k{i}"), "standard", 2_000);
        d.apply(Event::Enqueue(j));
        held.push(rx);
    }
    let refused = held
        .iter_mut()
        .map(|rx| rx.try_recv())
        .filter(|r| matches!(r, Ok(Err(Refusal::QueueFull(_)))))
        .count();
    assert_eq!(refused, 8 - 5, "five queued, the rest refused");
    let (j, mut rx) = job("other/w/p/k", "standard", 2_000);
    d.apply(Event::Enqueue(j));
    assert!(rx.try_recv().is_err(), "another org still queues");
}

/// A pool held full by one running request (so a queue means waiting), at `per_s`
/// dispatches a second.
fn saturated(max_total: usize, per_s: f64) -> (Dispatcher, Events, Assignment) {
    let (mut d, events) = dispatcher(max_total);
    let (hog, mut hog_rx) = job("hog", "standard", 1_000);
    d.apply(Event::Enqueue(hog));
    d.dispatch(0);
    let hog = assigned(&mut hog_rx);
    d.pools[0].paces.pool.per_s = per_s;
    (d, events, hog)
}

#[test]
fn a_tenant_with_nothing_queued_is_never_refused_for_another_s_backlog() {
    // Shapes drawn at random: queue bounds, one to four flooding orgs of one to five keys
    // each, their backlogs (past every bound), tiers and priorities, the pool's pace. A
    // newcomer with nothing queued — in an org of its own or in a flooding one, free tier
    // or not, a deadline a millisecond away — is queued, never refused; every refusal
    // falls on a tenant with work queued.
    let mut rng = fastrand::Rng::with_seed(crate::test_seed());
    for _ in 0..300 {
        let (mut d, _events, _hog) = saturated(rng.usize(4..120), rng.f64() * 10.0 + 0.001);
        d.queue.max_per_tenant = rng.usize(1..40);
        d.queue.max_per_org = rng.usize(1..80);
        d.queue.shed_free_tier_above = rng.f64();
        let mut replies = Vec::new();
        for org in 0..rng.usize(1..=4) {
            for key in 0..rng.usize(1..=5) {
                let tenant = format!("flood{org}/w/p/k{key}");
                for _ in 0..rng.usize(0..=100) {
                    let tier = if rng.bool() { "free" } else { "standard" };
                    let (mut j, rx) = job(&tenant, tier, rng.u64(1..2_000));
                    j.priority = if rng.bool() {
                        Priority::Batch
                    } else {
                        Priority::Interactive
                    };
                    d.apply(Event::Enqueue(j));
                    replies.push((tenant.clone(), rx));
                }
            }
        }
        let newcomer = if rng.bool() {
            "quiet/w/p/k".to_owned()
        } else {
            format!("flood0/w/p/new{}", rng.u32(..))
        };
        let tier = if rng.bool() { "free" } else { "standard" };
        let (mut j, mut rx) = job(&newcomer, tier, rng.u64(1..2_000));
        j.priority = if rng.bool() {
            Priority::Batch
        } else {
            Priority::Interactive
        };
        j.deadline_ms = now_ms() + 1;
        d.apply(Event::Enqueue(j));
        assert!(
            matches!(rx.try_recv(), Err(oneshot::error::TryRecvError::Empty)),
            "{newcomer} ({tier}) refused with nothing queued: {:?}; queue {:?}",
            rx.try_recv(),
            d.queue
        );
        assert_eq!(d.depth(&newcomer), 1);
    }
}

#[test]
fn a_tenant_s_own_backlog_is_refused_at_its_own_projected_wait() {
    // b has three queued; its pace is unmeasured, so it is its fair part of the pool's
    // (a half: b and the hog are active): 1 a second, so 3 s ahead of its next request.
    let (mut d, _events, _hog) = saturated(100, 2.0);
    d.queue.max_per_tenant = 100;
    for _ in 0..3 {
        let (j, _rx) = job("b", "standard", 500);
        d.apply(Event::Enqueue(j));
    }
    let (mut soon, mut soon_rx) = job("b", "standard", 500);
    soon.deadline_ms = now_ms() + 2_000;
    d.apply(Event::Enqueue(soon));
    let Ok(Err(Refusal::ProjectedWait(ms))) = soon_rx.try_recv() else {
        panic!("b's own backlog: refused");
    };
    assert!(
        (2_900..=3_000).contains(&ms),
        "3 ahead at 1 a second: {ms} ms"
    );
    // A deadline past its own wait is queued, whatever else is.
    let (mut later, mut later_rx) = job("b", "standard", 500);
    later.deadline_ms = now_ms() + 4_000;
    d.apply(Event::Enqueue(later));
    assert!(later_rx.try_recv().is_err());
    // Its measured pace, once known, is what counts: one in 8 s.
    let t0 = now_ms();
    d.pools[0].paces.dispatched("b", t0);
    for ms in (0..=8_000).step_by(25) {
        d.pools[0].paces.measure(t0 + ms, 4, |_| 4, 10_000);
    }
    let (mut again, mut again_rx) = job("b", "standard", 500);
    again.deadline_ms = now_ms() + 10_000;
    d.apply(Event::Enqueue(again));
    assert!(
        matches!(again_rx.try_recv(), Ok(Err(Refusal::ProjectedWait(_)))),
        "4 ahead at its own pace"
    );
}

#[test]
fn a_flood_held_back_by_the_headroom_is_refused_at_its_own_projected_wait() {
    // The pool has slots free (kept for a quiet tenant), so it is not full; the flood
    // cannot start more, so its backlog is a wait, projected and refused at once rather
    // than left to run into its deadline.
    let (mut d, _events) = slotted(2, 4);
    d.activate(0, "quiet", now_ms(), &[1.0]);
    let mut flood = enqueue(&mut d, "flood", 6);
    let _running = assigned_of(&mut flood);
    d.pools[0].paces.pool.per_s = 0.5;
    let soon = |d: &mut Dispatcher| {
        let (mut j, rx) = job("flood", "standard", 10);
        j.deadline_ms = now_ms() + 1_000;
        d.apply(Event::Enqueue(j));
        rx
    };
    let mut first = soon(&mut d);
    assert!(
        first.try_recv().is_err(),
        "nothing of its own ahead: queued"
    );
    let mut second = soon(&mut d);
    assert!(
        matches!(second.try_recv(), Ok(Err(Refusal::ProjectedWait(_)))),
        "one ahead at a quarter a second"
    );
}

#[test]
fn a_full_queue_refuses_the_longest_queue_s_newest_request_for_a_newcomer() {
    let (mut d, _events, _hog) = saturated(6, 1.0);
    d.queue.max_per_tenant = 10;
    d.queue.max_per_org = 10;
    let mut flood: Vec<Reply> = (0..4)
        .map(|_| {
            let (j, rx) = job("flood", "standard", 10);
            d.apply(Event::Enqueue(j));
            rx
        })
        .collect();
    let (j, _other_rx) = job("other", "standard", 10);
    d.apply(Event::Enqueue(j));
    let (j, _other_rx2) = job("other", "standard", 10);
    d.apply(Event::Enqueue(j));
    // Full (6 of 6). A newcomer takes the flood's newest request's place.
    let (j, mut quiet_rx) = job("quiet", "standard", 10);
    d.apply(Event::Enqueue(j));
    assert!(quiet_rx.try_recv().is_err(), "queued");
    assert!(matches!(
        flood[3].try_recv(),
        Ok(Err(Refusal::QueueFull(_)))
    ));
    assert!(flood[..3].iter_mut().all(|rx| rx.try_recv().is_err()));
    // The flood itself, the longest queue, is refused its next.
    let (j, mut more_rx) = job("flood", "standard", 10);
    d.apply(Event::Enqueue(j));
    assert!(matches!(more_rx.try_recv(), Ok(Err(Refusal::QueueFull(_)))));
}

#[test]
fn a_full_queue_whose_longest_key_waits_to_resume_still_takes_a_tenant_with_nothing_queued() {
    let (mut d, _events, _hog) = saturated(4, 1.0);
    d.queue.max_per_tenant = 10;
    d.queue.max_per_org = 10;
    // b's batch streams, preempted, wait at the head of its queue to resume (as `preempt`
    // queues them).
    let mut resuming = Vec::new();
    for _ in 0..3 {
        let (mut j, rx) = job("b", "standard", 10);
        (j.priority, j.preemptible, j.preemptions) = (Priority::Batch, true, 1);
        d.pools[0]
            .scheduler
            .push_front("b", &[1.0], Priority::Batch, j, 0);
        d.update_depth("b");
        resuming.push(rx);
    }
    let (j, _c_rx) = job("c", "standard", 10);
    d.apply(Event::Enqueue(j));
    // Full: 4 of 4. A newcomer with nothing queued.
    let (j, mut quiet_rx) = job("quiet", "standard", 10);
    d.apply(Event::Enqueue(j));
    let got = quiet_rx.try_recv();
    assert!(
        matches!(got, Err(oneshot::error::TryRecvError::Empty)),
        "refused with nothing queued: {got:?}"
    );
}

#[test]
fn a_full_queue_takes_a_newcomer_whose_org_has_less_queued_than_the_longest() {
    let (mut d, _events, _hog) = saturated(9, 1.0);
    d.queue.max_per_tenant = 10;
    d.queue.max_per_org = 10;
    let mut replies = Vec::new();
    let mut put = |d: &mut Dispatcher, t: &str, n: usize| {
        for _ in 0..n {
            let (j, rx) = job(t, "standard", 10);
            d.apply(Event::Enqueue(j));
            replies.push(rx);
        }
    };
    // Org "many": four keys of one queued each (4, the longest org); "long/k": 3; "new/k": 1.
    for i in 0..4 {
        put(&mut d, &format!("many/w/p/k{i}"), 1);
    }
    put(&mut d, "long/w/p/k", 3);
    put(&mut d, "new/w/p/k", 1);
    assert_eq!(d.queued(), 8);
    put(&mut d, "other/w/p/k", 1);
    assert_eq!(d.queued(), 9, "full");
    // new's org has 1 queued, against 4 for "many" and 3 for "long/k".
    let (j, mut rx) = job("new/w/p/k", "standard", 10);
    d.apply(Event::Enqueue(j));
    let got = rx.try_recv();
    assert!(
        matches!(got, Err(oneshot::error::TryRecvError::Empty)),
        "refused with less queued than the longest queue: {got:?}"
    );
}

#[test]
fn free_tier_is_not_shed_for_a_request_that_can_start_now() {
    // Invariant 16: shedding is computed for the tenant's place, never from the pool's
    // total backlog. A flood held back by the headroom has 50%+ of max_total queued while
    // slots are free; a free-tier tenant's two requests (a burst) could both start now.
    let (mut d, _events) = slotted(2, 8);
    d.queue.max_per_tenant = 100;
    d.queue.max_per_org = 100;
    d.activate(0, "quiet", now_ms(), &[1.0]);
    let mut flood = enqueue(&mut d, "flood", 70);
    let running = assigned_of(&mut flood);
    assert!(
        d.queued() >= 50,
        "{} queued, {} running",
        d.queued(),
        running.len()
    );
    let (a, mut a_rx) = job("cheap", "free", 10);
    let (b, mut b_rx) = job("cheap", "free", 10);
    d.apply(Event::Enqueue(a));
    d.apply(Event::Enqueue(b));
    d.dispatch(0);
    let _a = assigned(&mut a_rx);
    let _b = assigned(&mut b_rx);
}

#[test]
fn a_refusal_s_wait_does_not_follow_other_tenants_activity() {
    // b has 3 queued (its cap) in a saturated pool; its refusal's wait (Retry-After) is
    // its own backlog at its fair part of the pool's pace. Two other orgs send a request
    // each and leave at once (nothing queued, nothing held): b's Retry-After doubles, so
    // b learns how many other orgs are active (and, over refusals, the pool's pace).
    let (mut d, _events, _hog) = saturated(100, 2.0);
    let refused = |d: &mut Dispatcher| {
        let (j, mut rx) = job("b", "standard", 500);
        d.apply(Event::Enqueue(j));
        match rx.try_recv() {
            Ok(Err(Refusal::QueueFull(ms))) => ms,
            other => panic!("{other:?}"),
        }
    };
    let mut queued = Vec::new();
    for _ in 0..3 {
        let (j, rx) = job("b", "standard", 500);
        d.apply(Event::Enqueue(j));
        queued.push(rx);
    }
    let before = refused(&mut d);
    for t in ["x", "y"] {
        let (j, rx) = job(t, "standard", 10);
        drop(rx);
        d.apply(Event::Enqueue(j));
    }
    d.expire(now_ms());
    let after = refused(&mut d);
    assert_eq!(before, after, "b's wait moved with other orgs' activity");
}

#[test]
fn a_tenant_s_projected_wait_does_not_grow_with_orgs_that_have_nothing_queued() {
    // b has one request queued in a saturated pool (2 dispatches a second, b's pace not yet
    // measured) and sends another with 3 s to go: at its fair part against the hog (a
    // half) that is 1 s ahead, queued. Ten orgs then send a request each and leave at once
    // (nothing queued, nothing held, nothing billed): b's part becomes a twelfth, its
    // projection 6 s, and the same request is refused `projected_wait`.
    let (mut d, _events, _hog) = saturated(100, 2.0);
    let (j, _first) = job("b", "standard", 500);
    d.apply(Event::Enqueue(j));
    let soon = |d: &mut Dispatcher| {
        let (mut j, mut rx) = job("b", "standard", 500);
        j.deadline_ms = now_ms() + 3_000;
        d.apply(Event::Enqueue(j));
        rx.try_recv()
    };
    assert!(soon(&mut d).is_err(), "1 ahead at 1 a second: queued");
    for i in 0..10 {
        let (j, rx) = job(&format!("idle{i}"), "standard", 10);
        drop(rx);
        d.apply(Event::Enqueue(j));
    }
    d.expire(now_ms());
    let got = soon(&mut d);
    assert!(
        matches!(got, Err(oneshot::error::TryRecvError::Empty)),
        "refused for orgs that queue nothing: {got:?}"
    );
}
