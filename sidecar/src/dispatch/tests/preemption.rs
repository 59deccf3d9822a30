//! Batch streams preempted for waiting interactive work, and resumed.

use super::*;

#[test]
fn waiting_interactive_work_preempts_the_latest_arrived_batch_stream_which_resumes_first() {
    let (mut d, mut events) = slotted(1, 2);
    d.queue.preempt_batch_after_ms = 100;
    let batch = |d: &mut Dispatcher| {
        let (mut j, rx) = job("b", "standard", 10);
        j.priority = Priority::Batch;
        j.preemptible = true;
        j.deadline_ms = 5_000;
        d.apply(Event::Enqueue(j));
        d.dispatch(0);
        rx
    };
    let mut older = assigned(&mut batch(&mut d));
    let mut newer = assigned(&mut batch(&mut d));
    d.pools[0].running[1].job.arrived_ms = 50;
    let mut waiting = batch(&mut d);
    let (mut older_word, mut newer_word) = (
        older.take_preemption().unwrap(),
        newer.take_preemption().unwrap(),
    );

    let (mut i, mut i_rx) = job("i", "standard", 10);
    i.arrived_ms = 1_000;
    d.apply(Event::Enqueue(i));
    d.dispatch(1_000);
    assert!(i_rx.try_recv().is_err(), "no slot");
    let labels: Labels = &[("pool", "slots"), ("tier", "standard")];
    let preemptions = |d: &Dispatcher| d.metrics.preemptions.get(labels);
    d.preempt(0, 1_050);
    assert_eq!(preemptions(&d), 0, "not waited long enough yet");
    d.preempt(0, 1_100);
    assert_eq!(preemptions(&d), 0, "neither started: nothing to go on from");
    older.started(10);
    newer.started(10);
    settle(&mut d, &mut events);
    d.preempt(0, 1_100);
    let mut requeued = newer_word.try_recv().expect("the latest arrived goes");
    assert!(older_word.try_recv().is_err());
    assert_eq!(preemptions(&d), 1);
    assert_eq!(d.pools[0].scheduler.depth("b"), 2, "queued again");
    // Past the queue's deadline: the waiting request is dropped, the preempted one is not.
    d.expire(10_000);
    assert!(matches!(
        waiting.try_recv(),
        Ok(Err(Refusal::DeadlinePassed(_)))
    ));
    assert_eq!(d.pools[0].scheduler.depth("b"), 1);
    d.preempt(0, 1_100);
    assert_eq!(
        preemptions(&d),
        1,
        "one at a time, until its room comes back"
    );
    // Its relay lets it go: the slot goes to the interactive request.
    drop(newer);
    settle(&mut d, &mut events);
    let interactive = assigned(&mut i_rx);
    assert!(requeued.try_recv().is_err());
    assert_eq!(d.pools[0].pool.replicas[0].in_flight, 2);
    // Then the preempted one, ahead of its tenant's waiting request (one slot is kept for
    // the interactive tenant, active still).
    drop(interactive);
    drop(older);
    settle(&mut d, &mut events);
    let again = assigned(&mut requeued);
    assert_eq!(again.kv_held(), 10);
    assert_eq!(
        d.pools[0].scheduler.counter("b"),
        20.0,
        "its prompt charged once"
    );
}

/// A preemptible batch stream of tenant `b` (10 KV tokens), dispatched, and the word of
/// its preemption.
fn preemptible_stream(d: &mut Dispatcher) -> (Assignment, oneshot::Receiver<Requeued>) {
    let (mut b, mut b_rx) = job("b", "standard", 10);
    (b.priority, b.preemptible) = (Priority::Batch, true);
    d.apply(Event::Enqueue(b));
    d.dispatch(0);
    let mut running = assigned(&mut b_rx);
    let word = running.take_preemption().unwrap();
    (running, word)
}

/// An interactive request (10 KV tokens) of tenant `i`, queued.
fn waiting_interactive(d: &mut Dispatcher) -> Reply {
    let (i, i_rx) = job("i", "standard", 10);
    d.apply(Event::Enqueue(i));
    d.dispatch(0);
    i_rx
}

#[test]
fn a_preempted_stream_that_ran_past_its_prediction_is_dispatched_again_with_its_grown_hold() {
    let (mut d, mut events) = slotted(1, 1);
    d.queue.preempt_batch_after_ms = 10;
    let (mut running, mut word) = preemptible_stream(&mut d);
    running.started(10);
    // Past its prediction, its relay grew the hold to what the replica holds.
    running.resize(40);
    settle(&mut d, &mut events);
    let mut i_rx = waiting_interactive(&mut d);
    d.preempt(0, 100);
    let mut requeued = word.try_recv().expect("preempted");
    drop(running);
    settle(&mut d, &mut events);
    drop(assigned(&mut i_rx));
    settle(&mut d, &mut events);
    let again = assigned(&mut requeued);
    println!("hold after resuming: {}", again.kv_held());
    assert_eq!(again.kv_held(), 40, "it goes on from what it had generated");
    assert_eq!(d.pools[0].pool.replicas[0].reserved, 40);
    assert_eq!(d.tenant_kv["b"], 40);
    drop(again);
    settle(&mut d, &mut events);
    assert_eq!(d.pools[0].pool.replicas[0].reserved, 0);
}

#[test]
fn another_stream_of_the_preempted_tenant_ending_does_not_start_a_second_preemption() {
    let (mut d, mut events) = dispatcher(100);
    d.queue.preempt_batch_after_ms = 10;
    let budget = d.pools[0].pool.replicas[0].kv_budget;
    let unit = budget / 10;
    let batch = |d: &mut Dispatcher, kv, preemptible, arrived| {
        let (mut b, mut rx) = job("b", "standard", kv);
        (b.priority, b.preemptible, b.arrived_ms) = (Priority::Batch, preemptible, arrived);
        d.apply(Event::Enqueue(b));
        d.dispatch(0);
        let a = assigned(&mut rx);
        a.started(10);
        a
    };
    let mut older = batch(&mut d, 4 * unit, true, 0);
    let mut newer = batch(&mut d, 4 * unit, true, 1);
    let short = batch(&mut d, unit, false, 2);
    settle(&mut d, &mut events);
    let (mut older_word, mut newer_word) = (
        older.take_preemption().unwrap(),
        newer.take_preemption().unwrap(),
    );
    // Interactive work that fits once one 4-unit stream goes.
    let (i, mut i_rx) = job("i", "standard", 5 * unit);
    d.apply(Event::Enqueue(i));
    d.dispatch(0);
    assert!(i_rx.try_recv().is_err(), "no room");
    d.preempt(0, 100);
    let _requeued = newer_word.try_recv().expect("the latest arrived goes");
    // The tenant's short stream ends before the preempted one's relay lets it go.
    drop(short);
    settle(&mut d, &mut events);
    d.preempt(0, 100);
    assert!(
        older_word.try_recv().is_err(),
        "one preemption frees the room: no second victim while it is under way"
    );
    drop(newer);
    settle(&mut d, &mut events);
    assigned(&mut i_rx);
}

#[test]
fn a_stream_on_an_engine_that_cannot_continue_it_is_never_preempted() {
    let (mut d, _events) = slotted(1, 1);
    d.queue.preempt_batch_after_ms = 10;
    d.pools[0].pool.replicas[0].dialect = Some(Dialect::Tgi);
    let (mut b, mut b_rx) = job("b", "standard", 10);
    (b.priority, b.preemptible) = (Priority::Batch, true);
    d.apply(Event::Enqueue(b));
    d.dispatch(0);
    let mut running = assigned(&mut b_rx);
    assert!(running.take_preemption().is_none());
    assert!(d.pools[0].running.is_empty());
}

#[test]
fn a_stream_is_preempted_a_bounded_number_of_times_then_runs_to_its_end() {
    let (mut d, mut events) = slotted(1, 1);
    d.queue.preempt_batch_after_ms = 10;
    let (mut running, mut word) = preemptible_stream(&mut d);
    let later = now_ms() + 60_000;
    for _ in 0..MAX_PREEMPTIONS {
        running.started(10);
        settle(&mut d, &mut events);
        let mut i_rx = waiting_interactive(&mut d);
        d.preempt(0, later);
        let mut requeued = word.try_recv().expect("preempted");
        drop(running);
        settle(&mut d, &mut events);
        drop(assigned(&mut i_rx));
        settle(&mut d, &mut events);
        running = assigned(&mut requeued);
        match running.take_preemption() {
            Some(next) => word = next,
            None => break,
        }
    }
    assert!(
        running.take_preemption().is_none(),
        "after {MAX_PREEMPTIONS} preemptions it is not preemptible"
    );
    let labels: Labels = &[("pool", "slots"), ("tier", "standard")];
    assert_eq!(
        d.metrics.preemptions.get(labels),
        u64::from(MAX_PREEMPTIONS)
    );
}

#[test]
fn a_stream_runs_the_preemption_bound_from_its_first_byte_not_its_dispatch() {
    let (mut d, mut events) = slotted(1, 1);
    d.queue.preempt_batch_after_ms = 500;
    let (running, mut word) = preemptible_stream(&mut d);
    settle(&mut d, &mut events);
    // A long (re-)prefill: its first byte comes 900 ms after its dispatch.
    d.apply(Event::FirstByte {
        pool: 0,
        replica: running.replica,
        ticket: running.ticket,
        ttfb_ms: 900.0,
        prompt_tokens: 10,
    });
    let _i_rx = waiting_interactive(&mut d);
    d.preempt(0, 1_000);
    assert!(
        word.try_recv().is_err(),
        "100 ms of decoding: preempted now, it would prefill again for a token or two"
    );
    d.preempt(0, 1_400);
    word.try_recv()
        .expect("500 ms after its first byte it may go");
}

#[test]
fn a_preempted_request_whose_client_left_is_dropped_and_its_room_comes_back_once() {
    let (mut d, mut events) = slotted(1, 1);
    d.queue.preempt_batch_after_ms = 10;
    let (running, mut word) = preemptible_stream(&mut d);
    running.started(10);
    settle(&mut d, &mut events);
    let mut i_rx = waiting_interactive(&mut d);
    // Turned off by a reload: nothing is preempted; turned on again, it is.
    let reload = |d: &mut Dispatcher, after| {
        let queue = QueueConfig {
            preempt_batch_after_ms: after,
            ..d.queue.clone()
        };
        let pools = vec![spec(0, d.pools[0].pool.config.clone())];
        d.apply(Event::Configure { queue, pools });
    };
    reload(&mut d, 0);
    d.preempt(0, 100);
    assert!(word.try_recv().is_err());
    reload(&mut d, 10);
    d.preempt(0, 100);
    let requeued = word.try_recv().expect("preempted");
    // The relay lets the stream go, and its client leaves while it waits to resume.
    drop(running);
    drop(requeued);
    settle(&mut d, &mut events);
    let interactive = assigned(&mut i_rx);
    drop(interactive);
    settle(&mut d, &mut events);
    d.expire(100);
    assert!(d.pools[0].scheduler.is_empty(), "dropped, not dispatched");
    let r = &d.pools[0].pool.replicas[0];
    assert_eq!((r.reserved, r.in_flight), (0, 0));
    assert_eq!(d.tenant_kv["b"], 0);
}

#[test]
fn an_interactive_request_of_absurdly_many_sequences_does_not_panic_the_preemption() {
    let (mut d, mut events) = slotted(1, 2);
    d.queue.preempt_batch_after_ms = 10;
    let mut streams = Vec::new();
    for _ in 0..2 {
        let (mut b, mut rx) = job("b", "standard", 10);
        (b.priority, b.preemptible) = (Priority::Batch, true);
        d.apply(Event::Enqueue(b));
        d.dispatch(0);
        let a = assigned(&mut rx);
        a.started(10);
        streams.push(a);
    }
    settle(&mut d, &mut events);
    let (mut i, _i_rx) = job("i", "standard", 10);
    i.sequences = u64::MAX;
    d.apply(Event::Enqueue(i));
    d.dispatch(0);
    d.preempt(0, 100);
}
