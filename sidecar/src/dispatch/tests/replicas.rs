//! Replicas' limits, discovery and reloads as the dispatcher follows them.

use super::*;

#[test]
fn a_replica_that_joins_again_as_an_engine_with_no_kv_figure_keeps_none_of_the_last_ones() {
    let (mut d, _events) = dispatcher_of(&[pool_config("m", None)], 100);
    let joined = |kv_tokens, dialect| {
        Event::Replica(ReplicaEvent::Joined {
            pool: 0,
            replica: 0,
            limits: EngineLimits {
                max_concurrency: None,
                kv_tokens,
            },
            dialect,
        })
    };
    d.apply(joined(Some(50_000), Some(Dialect::Vllm)));
    assert_eq!(d.pools[0].pool.replicas[0].kv_budget, 50_000);
    d.apply(joined(None, Some(Dialect::Llamacpp)));
    assert_eq!(
        d.pools[0].pool.replicas[0].kv_budget, 0,
        "unknown, not vLLM's"
    );
}

#[test]
fn a_replica_takes_no_more_than_the_slots_its_engine_says_it_has() {
    let (mut d, _events) = slotted(1, 8);
    d.apply(Event::Replica(ReplicaEvent::Joined {
        pool: 0,
        replica: 0,
        limits: EngineLimits {
            max_concurrency: Some(3),
            kv_tokens: None,
        },
        dialect: Some(Dialect::Vllm),
    }));
    let mut replies = enqueue(&mut d, "t", 3);
    replies.extend(enqueue(&mut d, "u", 3));
    let running = assigned_of(&mut replies);
    assert_eq!(running.len(), 3, "3 slots, whatever the KV says");
}

#[test]
fn an_unstarted_request_lowers_the_replica_s_limit_and_started_ones_raise_it_again() {
    let (mut d, mut events) = slotted(1, 4);
    let mut first = enqueue(&mut d, "t", 4);
    let running = assigned_of(&mut first);
    assert_eq!(running.len(), 4);
    running[0].not_started();
    drop(running);
    settle(&mut d, &mut events);
    assert_eq!(d.pools[0].pool.replicas[0].limit(), 2, "halved");
    let metrics = d.metrics.replica_first_byte_timeouts.clone();
    assert_eq!(metrics.get(&[("replica", "http://r0")]), 1);
    let mut again = enqueue(&mut d, "t", 4);
    let running = assigned_of(&mut again);
    assert_eq!(running.len(), 2, "two at once now");
    // The engine starts them at once again: the limit climbs back to its slots.
    for a in &running {
        a.started(100);
    }
    settle(&mut d, &mut events);
    assert_eq!(d.pools[0].pool.replicas[0].limit(), 4);
    assert_eq!(assigned_of(&mut again).len(), 2, "the other two go");
}

#[test]
fn an_engine_holding_a_queue_gets_nothing_more_and_without_kv_figures_its_limit_drops() {
    let busy = EngineSample {
        running: 3,
        waiting: 2,
        ..EngineSample::default()
    };
    let sample = || {
        Event::Replica(ReplicaEvent::Sample {
            pool: 0,
            replica: 0,
            sample: Some(busy),
        })
    };
    // KV figures: weir's KV estimate fell short; the limit stays, nothing more goes.
    let (mut d, mut events) = slotted(1, 8);
    let mut first = enqueue(&mut d, "t", 5);
    let _running = assigned_of(&mut first);
    d.apply(sample());
    assert_eq!(d.pools[0].pool.replicas[0].limit(), 8);
    let mut more = enqueue(&mut d, "t", 1);
    settle(&mut d, &mut events);
    assert!(assigned_of(&mut more).is_empty());
    // No KV figures (llama.cpp, TGI): a queue is a shortage of slots.
    let (mut d, _events) = slotted(1, 8);
    d.pools[0].pool.replicas[0].kv_budget = 0;
    let mut first = enqueue(&mut d, "t", 5);
    let _running = assigned_of(&mut first);
    d.apply(sample());
    d.apply(sample());
    assert_eq!(d.pools[0].pool.replicas[0].limit(), 3);
}

#[test]
fn a_discovered_replica_is_probed_before_work_and_a_vanished_one_drains_then_leaves() {
    let config = PoolConfig {
        discovery: Some(DiscoveryConfig {
            dns: "svc".into(),
            port: 80,
            scheme: crate::config::Scheme::Http,
            interval_ms: 1000,
        }),
        max_concurrency_per_replica: Some(1),
        ..pool_config("m", Some(1_000))
    };
    let (d, mut events) = dispatcher_of(std::slice::from_ref(&config), 100);
    let (health, mut started) = mpsc::unbounded_channel();
    let mut d = d.with_health(health);
    assert_eq!(commands(&mut started), [(true, 0, 0)], "the listed one");
    let found = |urls: &[&str]| {
        Event::Replica(ReplicaEvent::Discovered {
            pool: 0,
            source: config.discovery.clone().unwrap(),
            replicas: urls.iter().map(|u| u.to_string()).collect(),
        })
    };
    d.apply(found(&["http://10.0.0.1:80"]));
    assert_eq!(commands(&mut started), [(true, 0, 1)]);
    // Another name's answer (a discovery since replaced) changes nothing.
    let mut stale = found(&[]);
    if let Event::Replica(ReplicaEvent::Discovered { source, .. }) = &mut stale {
        source.dns = "old".into();
    }
    d.apply(stale);
    assert_eq!(d.pools[0].pool.replicas.len(), 2);

    // The listed replica is busy: the next job waits for the new one's probes.
    let (a, mut a_rx) = job("t", "standard", 10);
    d.apply(Event::Enqueue(a));
    d.dispatch(0);
    let first = assigned(&mut a_rx);
    assert_eq!(first.replica, 0);
    let (b, mut b_rx) = job("t", "standard", 10);
    d.apply(Event::Enqueue(b));
    d.dispatch(0);
    assert!(b_rx.try_recv().is_err(), "unprobed: no work yet");
    probed(&mut d, 0, 1);
    d.dispatch(0);
    let second = assigned(&mut b_rx);
    assert_eq!(
        second.url, "http://10.0.0.1:80",
        "the new replica gets work"
    );

    // It vanishes while its request runs: no new work, still there, then gone.
    d.apply(found(&[]));
    assert!(d.pools[0].pool.replica(1).is_some_and(|r| r.leaving));
    let (tx, mut ready) = oneshot::channel();
    d.apply(Event::Ready(tx));
    let ready = ready.try_recv().unwrap();
    assert_eq!(ready.pools[0].replicas.len(), 2, "/ready shows it leaving");
    assert!(ready.pools[0].replicas[1].leaving);
    assert!(
        commands(&mut started).is_empty(),
        "still checked while it drains"
    );
    drop(second);
    settle(&mut d, &mut events);
    assert!(
        d.pools[0].pool.replica(1).is_none(),
        "dropped once its request ended"
    );
    assert_eq!(commands(&mut started), [(false, 0, 1)]);
    assert_eq!(
        d.tenant_kv["t"], 10,
        "only the first request's hold remains"
    );
    // Late events about it find nothing.
    probed(&mut d, 0, 1);
    drop(first);
    settle(&mut d, &mut events);
    assert_eq!(d.tenant_kv["t"], 0);
}

#[test]
fn a_reload_adds_and_retires_pools_and_changes_bounds_for_the_next_decision() {
    let (d, mut events) = dispatcher(100);
    let (health, mut started) = mpsc::unbounded_channel();
    let mut d = d.with_health(health);
    commands(&mut started);
    let counter = |d: &Dispatcher| d.pools[0].scheduler.counter("t");
    let (a, mut a_rx) = job("t", "standard", 600);
    d.apply(Event::Enqueue(a));
    d.dispatch(0);
    let running = assigned(&mut a_rx);
    let charged = counter(&d);
    assert!(charged > 0.0);

    // Pool b is added; the queue takes 1 per tenant from now on.
    let queue = QueueConfig {
        max_per_tenant: 1,
        ..QueueConfig::default()
    };
    d.apply(Event::Configure {
        queue: queue.clone(),
        pools: vec![
            spec(0, pool_config("m", Some(1_000))),
            spec(1, pool_config("b", Some(1_000))),
        ],
    });
    assert_eq!(d.pools.len(), 2);
    assert_eq!(commands(&mut started), [(true, 1, 0)]);
    assert_eq!(counter(&d), charged, "counters stay");
    assert_eq!(
        d.pools[0].pool.replicas[0].in_flight, 1,
        "the running request stays"
    );
    let (w, mut w_rx) = job("t", "standard", 600);
    d.apply(Event::Enqueue(w));
    let (over, mut over_rx) = job("t", "standard", 10);
    d.apply(Event::Enqueue(over));
    assert!(
        matches!(over_rx.try_recv(), Ok(Err(Refusal::QueueFull(_)))),
        "the new bound holds at once"
    );

    // Pool m is removed with a request queued: it keeps its replica until that is done.
    d.apply(Event::Configure {
        queue,
        pools: vec![spec(1, pool_config("b", Some(1_000)))],
    });
    assert!(d.pools[0].pool.retired);
    assert_eq!(d.pools[0].pool.replicas.len(), 1);
    let (late, mut late_rx) = job_in(0, "u", "standard", 10);
    d.apply(Event::Enqueue(late));
    assert!(matches!(late_rx.try_recv(), Ok(Err(Refusal::NoReplica))));
    drop(running);
    settle(&mut d, &mut events);
    let (tx, mut ready) = oneshot::channel();
    d.apply(Event::Ready(tx));
    let ready = ready.try_recv().unwrap();
    assert_eq!(ready.pools.len(), 1, "/ready shows the pools configured");
    assert_eq!(ready.pools[0].model, "b");
    // The queued request went to the replica it waited for; once it ends, and the
    // queue is empty, the retired pool's replica leaves.
    let queued = assigned(&mut w_rx);
    assert_eq!(queued.pool, 0);
    d.reconcile(0);
    assert_eq!(
        d.pools[0].pool.replicas.len(),
        1,
        "leaving, its request runs"
    );
    drop(queued);
    settle(&mut d, &mut events);
    assert!(d.pools[0].pool.replicas.is_empty());
    assert_eq!(commands(&mut started), [(false, 0, 0)]);
}

#[test]
fn a_reload_changes_a_pool_s_limits_and_isolation_for_its_replicas() {
    let (mut d, _events) = slotted(1, 4);
    assert_eq!(d.pools[0].pool.replicas[0].limit(), 4);
    let config = PoolConfig {
        max_concurrency_per_replica: Some(2),
        kv_tokens_per_replica: Some(50),
        cache_isolation: crate::config::engine::CacheIsolation::Shared,
        ..d.pools[0].pool.config.clone()
    };
    let mut link = d.pools[0].link.subscribe();
    d.apply(Event::Configure {
        queue: d.queue.clone(),
        pools: vec![spec(0, config)],
    });
    let r = &d.pools[0].pool.replicas[0];
    assert_eq!((r.limit(), r.kv_budget), (2, 50));
    assert_eq!(r.isolation, Isolation::Shared);
    assert!(link.has_changed().unwrap(), "health checks follow the pool");
    assert_eq!(
        link.borrow_and_update().cache_isolation,
        crate::config::engine::CacheIsolation::Shared
    );
}
