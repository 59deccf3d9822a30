//! The headroom rule as the dispatcher applies it: a turn for every active tenant, within a pool.

use super::*;

#[test]
fn the_headroom_rule_holds_within_a_pool_not_across_pools() {
    let (mut d, _events) = dispatcher_of(
        &[pool_config("a", Some(1_000)), pool_config("b", Some(1_000))],
        100,
    );
    let mut held = Vec::new();
    for pool in [0, 1] {
        let (j, mut rx) = job_in(pool, "big", "standard", 700);
        d.apply(Event::Enqueue(j));
        d.dispatch(0);
        held.push(assigned(&mut rx));
    }
    // Another tenant active in pool a only: big's share of a is capped, not of b.
    let (other, _other_rx) = job_in(0, "other", "standard", 100);
    d.apply(Event::Enqueue(other));
    d.dispatch(0);
    let (in_a, mut in_a_rx) = job_in(0, "big", "standard", 200);
    let (in_b, mut in_b_rx) = job_in(1, "big", "standard", 200);
    d.apply(Event::Enqueue(in_a));
    d.apply(Event::Enqueue(in_b));
    d.dispatch(0);
    assert!(in_a_rx.try_recv().is_err(), "700 + 200 > 80% of a");
    assigned(&mut in_b_rx);
}

#[test]
fn a_flooding_tenant_leaves_headroom_once_others_are_active() {
    let (mut d, mut events) = dispatcher(100);
    let mut rx = Vec::new();
    for _ in 0..2 {
        let (j, r) = job("noisy", "standard", 450);
        d.apply(Event::Enqueue(j));
        rx.push(r);
    }
    d.dispatch(0);
    let mut held: Vec<Assignment> = rx.iter_mut().map(assigned).collect();
    // "alone, it may fill the pool"
    drop(held.pop());
    settle(&mut d, &mut events);
    let (small, mut small_rx) = job("small", "standard", 100);
    d.apply(Event::Enqueue(small));
    let (more, mut more_rx) = job("noisy", "standard", 400);
    d.apply(Event::Enqueue(more));
    d.dispatch(0);
    assigned(&mut small_rx);
    assert!(
        more_rx.try_recv().is_err(),
        "450 + 400 > 80% of 1000 while small is active"
    );
}

#[test]
fn while_others_are_active_no_tenant_takes_every_slot() {
    let (mut d, _events) = slotted(2, 5);
    let mut small = enqueue(&mut d, "small", 1);
    let mut noisy = enqueue(&mut d, "noisy", 10);
    let _small_running = assigned_of(&mut small);
    let noisy_running = assigned_of(&mut noisy);
    assert_eq!(
        noisy_running.len(),
        7,
        "20% of 10 slots kept free while small is below its part"
    );
    // A slot is left for the others: a small tenant's next request starts at once.
    let mut next = enqueue(&mut d, "small", 1);
    assert_eq!(assigned_of(&mut next).len(), 1);

    // Three others active, each running one of its fair two: the flood keeps to its two,
    // and a slot stays free for each of the others' next request.
    let (mut d, _events) = slotted(2, 4);
    let mut smalls: Vec<Vec<Reply>> = ["s1", "s2", "s3"]
        .map(|t| enqueue(&mut d, t, 1))
        .into_iter()
        .collect();
    let _running: Vec<Assignment> = smalls.iter_mut().flat_map(|s| assigned_of(s)).collect();
    let mut noisy = enqueue(&mut d, "noisy", 10);
    assert_eq!(assigned_of(&mut noisy).len(), 2);
    let mut bursts: Vec<Vec<Reply>> = ["s1", "s2", "s3"]
        .map(|t| enqueue(&mut d, t, 1))
        .into_iter()
        .collect();
    let burst: usize = bursts.iter_mut().map(|b| assigned_of(b).len()).sum();
    assert_eq!(
        burst, 3,
        "each small tenant's second request starts at once"
    );

    // Alone, a tenant may use the whole pool.
    let (mut d, _events) = slotted(2, 4);
    let mut alone = enqueue(&mut d, "noisy", 10);
    assert_eq!(assigned_of(&mut alone).len(), 8);
}

#[test]
fn several_floods_together_leave_a_turn_for_each_quiet_tenant() {
    // Four tenants flood a pool of 8 slots (two replicas of 4) while two quiet ones are
    // active; the quiet ones' requests then start at once. Before, each flood was held to
    // its own share of slots only, and together they took all eight.
    let (mut d, mut events) = slotted(2, 4);
    for t in ["q1", "q2", "f1", "f2", "f3", "f4"] {
        d.activate(0, t, now_ms(), &[1.0]);
    }
    let mut floods: Vec<Vec<Reply>> = ["f1", "f2", "f3", "f4"]
        .map(|t| enqueue(&mut d, t, 8))
        .into_iter()
        .collect();
    let mut running: Vec<Assignment> = floods.iter_mut().flat_map(|f| assigned_of(f)).collect();
    assert_eq!(running.len(), 6, "a slot kept for each quiet tenant");
    let mut quiet = Vec::new();
    for q in ["q1", "q2"] {
        quiet.extend(assigned_of(&mut enqueue(&mut d, q, 1)));
        assert_eq!(
            quiet.len(),
            usize::from(q == "q2") + 1,
            "{q} starts at once"
        );
    }
    // A stream of the flood past its part ends while a quiet tenant waits: the slot is the
    // quiet one's (the floods' long answers were charged to their counters as they
    // streamed; it is lifted to theirs as it queues, and goes first on the tie).
    for f in ["f1", "f2", "f3", "f4"] {
        let (pool, tenant, output_tokens) = (0, f.to_owned(), 500);
        d.apply(Event::Served {
            pool,
            replica: 0,
            tenant,
            output_tokens,
        });
    }
    let mut waiting = enqueue(&mut d, "q1", 1);
    assert!(matches!(
        waiting[0].try_recv(),
        Err(oneshot::error::TryRecvError::Empty)
    ));
    drop(running.remove(0));
    settle(&mut d, &mut events);
    d.dispatch(0);
    assert_eq!(assigned_of(&mut waiting).len(), 1);
    let more: usize = floods.iter_mut().map(|f| assigned_of(f).len()).sum();
    assert_eq!(more, 0, "no flood took it");

    // Replicas of different limits (1 and 3): the rule counts the pool's slots.
    let (mut d, _events) = slotted(2, 3);
    d.pools[0].pool.replicas[0].limiter.restart(Some(1));
    d.activate(0, "q", now_ms(), &[1.0]);
    let mut flood = enqueue(&mut d, "f", 8);
    assert_eq!(assigned_of(&mut flood).len(), 3, "one of 4 slots kept");
    let mut quiet = enqueue(&mut d, "q", 1);
    assert_eq!(assigned_of(&mut quiet).len(), 1);
}

#[test]
fn many_keys_of_one_org_hold_one_share_of_slots() {
    // An org mints 8 keys and floods from each: it is one share, so a slot stays free
    // for the other org.
    let (mut d, _events) = slotted(2, 4);
    d.activate(0, "other/w/p/k", now_ms(), &[1.0]);
    let mut floods: Vec<Vec<Reply>> = (0..8)
        .map(|i| enqueue(&mut d, &format!("minted/w/p/k{i}"), 2))
        .collect();
    let running: usize = floods.iter_mut().map(|f| assigned_of(f).len()).sum();
    assert_eq!(running, 6);
    let mut quiet = enqueue(&mut d, "other/w/p/k", 1);
    assert_eq!(assigned_of(&mut quiet).len(), 1);
}

#[test]
fn a_tenant_backlogged_past_the_active_window_keeps_its_part() {
    // b and f each queue 40 at once (8 slots): both backlogged. 20 s later both still are;
    // f has sent one more request since, b (a batch submitted once, waiting) has not. b's
    // key is no longer active for the headroom though it has work queued: f is treated as
    // alone and b as past a part of nothing, held to leaving the headroom free.
    let (mut d, mut events) = slotted(2, 4);
    (d.queue.max_per_tenant, d.queue.max_per_org) = (100, 100);
    d.activate(0, "b", 0, &[1.0]);
    d.activate(0, "f", 0, &[1.0]);
    let (mut b, mut f) = (Vec::new(), Vec::new());
    for _ in 0..40 {
        b.extend(enqueue(&mut d, "b", 1));
        f.extend(enqueue(&mut d, "f", 1));
    }
    let mut running: std::collections::VecDeque<(bool, Assignment)> =
        (assigned_of(&mut b).into_iter().map(|a| (true, a)))
            .chain(assigned_of(&mut f).into_iter().map(|a| (false, a)))
            .collect();
    let later = 20_000;
    d.pools[0].shares.expire(later, d.queue.active_window_ms);
    let (mut j, rx) = job("f", "standard", 10);
    j.arrived_ms = later;
    d.apply(Event::Enqueue(j));
    f.push(rx);
    // Streams end one at a time, oldest first; each freed slot goes to the next in order.
    let (mut b_started, mut f_started) = (0, 0);
    for _ in 0..24 {
        drop(running.pop_front());
        settle(&mut d, &mut events);
        for a in assigned_of(&mut b) {
            b_started += 1;
            running.push_back((true, a));
        }
        for a in assigned_of(&mut f) {
            f_started += 1;
            running.push_back((false, a));
        }
    }
    let b_running = running.iter().filter(|(is_b, _)| *is_b).count();
    assert!(
        b_started * 2 >= f_started,
        "both backlogged: b started {b_started}, f {f_started}; b runs {b_running} of 8"
    );
}

#[test]
fn a_backlogged_tenant_holding_nothing_is_not_kept_off_a_replica_answering_a_quiet_request() {
    let (mut d, mut events) = slotted(2, 4);
    let a = d.pools[0].pool.affine(0).unwrap();
    let mut f0 = enqueue(&mut d, "f", 1);
    drop(assigned_of(&mut f0));
    settle(&mut d, &mut events); // f active, holding nothing
    d.pools[0].pool.replicas[1 - a].in_flight = 4; // the other replica full
    let mut q = enqueue(&mut d, "q", 1);
    let mut held = assigned_of(&mut q);
    assert_eq!(d.pools[0].pool.replicas[a].answering.len(), 1);
    // f queues two: a backlog within its part, whose turn a quiet tenant's answers, one
    // after another on the free replica, must not keep from it.
    let (j1, mut r1) = job("f", "standard", 10);
    let (j2, _r2) = job("f", "standard", 10);
    d.apply(Event::Enqueue(j1));
    d.apply(Event::Enqueue(j2));
    d.dispatch(0);
    for step in 1..=20u64 {
        let now = step * 500;
        for r in &mut d.pools[0].pool.replicas {
            r.unguard_older(now);
        }
        let (j, rx) = job("q", "standard", 10);
        let mut more = vec![rx];
        d.apply(Event::Enqueue(j));
        d.dispatch(now);
        held.extend(assigned_of(&mut more));
        held.remove(0);
        while let Ok(e) = events.1.try_recv() {
            d.apply(e);
        }
        d.dispatch(now);
    }
    assert!(
        r1.try_recv().is_ok(),
        "f, holding nothing, never got its turn in 10 s"
    );
}
