use super::*;

fn rx(state: ReceiverState) -> ReceiverProgress {
    let mut r = ReceiverProgress::new("h1", state);
    r.total = 100;
    r
}

fn seen(bytes: u64, complete: bool, gpu: Option<(u64, GpuState)>) -> Seen {
    Seen {
        bytes,
        complete,
        gpu,
        store_failures: Vec::new(),
    }
}

#[test]
fn the_replan_budget_counts_replans_without_progress_in_between() {
    let mut r = rx(ReceiverState::Receiving);
    // Three re-plans in a row with no byte moved, then no more.
    assert!(r.replanned(3) && r.replanned(3) && r.replanned(3));
    assert!(!r.replanned(3));
    // Bytes moved since the last one: a new count (a rolling restart's receivers).
    let mut r = rx(ReceiverState::Receiving);
    for step in 1..=10 {
        r.bytes = step * 5;
        assert!(r.replanned(3), "re-plan {step} after progress");
    }
    assert_eq!(r.fruitless_replans, 1);
}

#[test]
fn a_store_that_refuses_the_data_fails_the_receiver_at_once_saying_why() {
    let mut r = rx(ReceiverState::Receiving);
    let mut s = seen(40, false, None);
    s.store_failures = vec![(
        "s1".into(),
        "storing chunk 3 of shard 0: No space left on device".into(),
    )];
    assert!(r.observe(&s, None, &round(Tier::Memory, Some(100), 1.0)));
    assert_eq!(r.state, ReceiverState::Failed);
    assert!(r.error.contains("No space left on device"), "{}", r.error);
    // Another plan's refusal (an older session of the model) is not this plan's.
    let mut old = seen(10, false, None);
    old.store_failures = vec![("old".into(), "full".into()), ("s1".into(), "ours".into())];
    let mine = old.clone().for_sessions(["s1", "s2"].into_iter());
    assert_eq!(mine.store_failure(), Some("ours"));
    assert_eq!(old.for_sessions(["s2"].into_iter()).store_failure(), None);
    // A copy that completed anyway is done.
    let mut s = seen(100, true, None);
    s.store_failures = vec![("s1".into(), "an old refusal".into())];
    assert!(r.observe(&s, None, &round(Tier::Memory, Some(100), 2.0)));
    assert_eq!(r.state, ReceiverState::Done);
}

/// A round of a memory plan without a lost grace.
fn round(tier: Tier, total: Option<u64>, elapsed: f64) -> Round {
    Round {
        tier,
        total,
        elapsed,
        now: 0.0,
        lost_grace: 0.0,
    }
}

#[test]
fn a_refused_store_waits_for_room_within_the_grace_then_resumes() {
    let mut r = rx(ReceiverState::Receiving);
    let mut s = seen(40, false, None);
    s.store_failures = vec![("s1".into(), "No space left on device".into())];
    // With a lost grace, the report itself makes it lost, awaiting room.
    let mut graced = r.clone();
    let with_grace = Round {
        now: 50.0,
        lost_grace: 20.0,
        ..round(Tier::Memory, Some(100), 1.0)
    };
    assert!(graced.observe(&s, None, &with_grace));
    assert_eq!(graced.state, ReceiverState::Lost);
    assert!(graced.awaits_room && graced.awaits_return(60.0, 20.0));
    assert!(r.observe(&s, None, &round(Tier::Memory, Some(100), 1.0)));
    // Without a grace it stays failed.
    let mut no_grace = r.clone();
    no_grace.wait_for_room(50.0, 0.0);
    assert_eq!(no_grace.state, ReceiverState::Failed);
    r.wait_for_room(50.0, 20.0);
    assert_eq!(r.state, ReceiverState::Lost);
    assert!(r.awaits_return(60.0, 20.0) && !r.awaits_return(71.0, 20.0));
    assert!(r.error.contains("No space left on device"), "{}", r.error);
    assert!(r.error.contains("waits up to 20s for room"), "{}", r.error);
    // 60 of 100 bytes still to come.
    assert!(!r.room_for_rest(59));
    assert!(r.room_for_rest(60));
    r.come_back();
    assert_eq!(r.state, ReceiverState::Receiving);
    assert!(
        !r.awaits_room && r.error.contains("room again"),
        "{}",
        r.error
    );
    // A receiver lost for another reason does not wait for room.
    assert!(rx(ReceiverState::Lost).room_for_rest(0));
}

#[test]
fn a_deferred_return_renews_the_grace_and_says_why_once() {
    let mut r = rx(ReceiverState::Receiving);
    r.lose("gone", 10.0);
    assert!(r.awaits_return(25.0, 20.0) && !r.awaits_return(31.0, 20.0));
    r.defer_return(25.0);
    r.defer_return(26.0);
    assert!(
        r.awaits_return(45.0, 20.0),
        "the grace counts from the last deferral"
    );
    assert_eq!(
        r.error
            .matches("waiting for a peer's complete copy")
            .count(),
        1
    );
    r.come_back();
    assert_eq!(r.state, ReceiverState::Receiving);
    assert!(!r.error.contains("waiting for a peer"), "{}", r.error);
}

#[test]
fn names_round_trip_and_unknown_names_are_errors() {
    for s in ReceiverState::ALL {
        assert_eq!(s.as_str().parse::<ReceiverState>(), Ok(*s));
        let json = serde_json::to_string(s).unwrap();
        assert_eq!(json, format!("\"{}\"", s.as_str()));
    }
    for s in GpuState::ALL {
        assert_eq!(s.as_str().parse::<GpuState>(), Ok(*s));
    }
    for s in PlanState::ALL {
        assert_eq!(s.as_str().parse::<PlanState>(), Ok(*s));
    }
    let e = "sleeping".parse::<ReceiverState>().unwrap_err();
    assert!(
        e.to_string()
            .starts_with("unknown ReceiverState \"sleeping\" (known: pending, receiving,"),
        "{e}"
    );
}

#[test]
fn pending_receives_then_completes_in_a_data_tier() {
    let mut r = rx(ReceiverState::Pending);
    assert!(!r.observe(&seen(0, false, None), None, &round(Tier::Memory, None, 1.0)));
    assert!(r.observe(
        &seen(40, false, None),
        None,
        &round(Tier::Memory, None, 2.0)
    ));
    assert_eq!(r.state, ReceiverState::Receiving);
    assert!(r.observe(
        &seen(100, true, None),
        None,
        &round(Tier::Memory, Some(100), 3.0)
    ));
    assert_eq!(
        (r.state, r.bytes, r.done_s),
        (ReceiverState::Done, 100, 3.0)
    );
    // Seen again: nothing changes, the time it was done stays.
    assert!(!r.observe(
        &seen(100, true, None),
        None,
        &round(Tier::Memory, Some(100), 9.0)
    ));
    assert_eq!(r.done_s, 3.0);
}

#[test]
fn tier_gpu_is_done_only_once_the_gpus_serve() {
    let mut r = rx(ReceiverState::Receiving);
    r.gpus = 1;
    let loading = seen(100, true, Some((10, GpuState::Loading)));
    assert!(r.observe(&loading, None, &round(Tier::Gpu, None, 1.0)));
    assert_eq!(r.state, ReceiverState::Loading);
    assert_eq!(r.gpu_state, Some(GpuState::Loading));
    let resident = seen(100, true, Some((100, GpuState::Resident)));
    assert!(r.observe(&resident, None, &round(Tier::Gpu, None, 2.0)));
    assert_eq!(r.state, ReceiverState::Done);

    // A failed load fails the receiver, with a reason.
    let mut r = rx(ReceiverState::Receiving);
    r.gpus = 2;
    assert!(r.observe(
        &seen(100, true, Some((5, GpuState::Failed))),
        None,
        &round(Tier::Gpu, None, 1.0)
    ));
    assert_eq!(r.state, ReceiverState::Failed);
    assert!(r.error.contains("GPUs failed"), "{}", r.error);

    // A host that cannot load: done once the data is here, with the reason kept.
    let mut r = rx(ReceiverState::Receiving);
    r.gpus = 1;
    assert!(r.observe(
        &seen(100, true, None),
        Some("GPU load refused"),
        &round(Tier::Gpu, None, 1.0)
    ));
    assert_eq!(r.state, ReceiverState::Done);
    assert_eq!(r.gpu_state, Some(GpuState::Unavailable));
    assert_eq!(r.error, "GPU load refused");
}

#[test]
fn gpu_state_of_several_gpus() {
    assert_eq!(GpuState::of_gpus([]), None);
    assert_eq!(
        GpuState::of_gpus(["resident", "resident"]),
        Some(GpuState::Resident)
    );
    assert_eq!(
        GpuState::of_gpus(["resident", "partition-live"]),
        Some(GpuState::PartitionLive)
    );
    assert_eq!(
        GpuState::of_gpus(["resident", "loading"]),
        Some(GpuState::Loading)
    );
    assert_eq!(
        GpuState::of_gpus(["resident", "failed"]),
        Some(GpuState::Failed)
    );
    // A state this build does not know is still loading, not done.
    assert_eq!(GpuState::of_gpus(["warming"]), Some(GpuState::Loading));
}

#[test]
fn burst_host_goes_live_then_completes_or_fails() {
    let mut r = rx(ReceiverState::Loading);
    assert!(r.observe_burst(&seen(30, false, Some((30, GpuState::Loading))), 1.0));
    assert_eq!(r.live_s, 0.0);
    assert!(r.observe_burst(&seen(50, false, Some((50, GpuState::PartitionLive))), 2.0));
    assert_eq!(r.live_s, 2.0);
    assert_eq!(r.state, ReceiverState::Loading);
    assert!(r.observe_burst(&seen(100, true, Some((100, GpuState::Resident))), 5.0));
    assert_eq!(
        (r.state, r.live_s, r.bytes),
        (ReceiverState::Done, 2.0, 100)
    );

    let mut r = rx(ReceiverState::Loading);
    assert!(r.observe_burst(&seen(10, false, Some((1, GpuState::Failed))), 1.0));
    assert_eq!(r.state, ReceiverState::Failed);
}

#[test]
fn lost_or_failed_receivers_recover_from_a_heartbeat() {
    let mut r = rx(ReceiverState::Lost);
    assert_eq!(
        r.recover(Tier::Memory, false, 7.0),
        Some(ReceiverState::Lost)
    );
    assert_eq!(
        (r.state, r.bytes, r.done_s),
        (ReceiverState::Done, 100, 7.0)
    );
    assert!(r.error.contains("marked lost"));
    // Done already: nothing to recover.
    assert_eq!(r.recover(Tier::Memory, false, 8.0), None);
    // Tier gpu with slots: only once resident.
    let mut r = rx(ReceiverState::Failed);
    r.gpus = 1;
    assert_eq!(r.recover(Tier::Gpu, false, 1.0), None);
    assert_eq!(r.recover(Tier::Gpu, true, 1.0), Some(ReceiverState::Failed));
    // An active receiver is the plan runner's to update.
    let mut r = rx(ReceiverState::Receiving);
    assert_eq!(r.recover(Tier::Memory, false, 1.0), None);
}

fn plan(states: &[ReceiverState]) -> Plan {
    let hosts = states
        .iter()
        .enumerate()
        .map(|(i, s)| ReceiverProgress::new(format!("h{i}"), *s))
        .collect();
    Plan {
        estimate_s: 1.0,
        ..Plan::started(
            "p",
            ("m", "d"),
            Tier::Memory,
            PlanKind::Chains,
            hosts,
            "file:///m",
            10.0,
        )
    }
}

#[test]
fn a_lost_receiver_keeps_its_plan_running_for_the_grace_then_not() {
    use ReceiverState::*;
    let mut p = plan(&[Done, Receiving]);
    assert!(p.hosts[1].lose("gone", 20.0));
    assert_eq!(p.hosts[1].lost_at, 20.0);
    // Lost again later: the first time stays.
    p.hosts[1].lose("gone", 25.0);
    assert_eq!(p.hosts[1].lost_at, 20.0);
    assert!(p.hosts[1].awaits_return(29.0, 10.0));
    assert!(!p.settle_after(29.0, 10.0));
    assert!(p.running());
    // Back within the grace: receiving again, no longer lost.
    p.hosts[1].come_back();
    assert_eq!((p.hosts[1].state, p.hosts[1].lost_at), (Receiving, 0.0));
    assert!(!p.settle_after(31.0, 10.0));
    // Lost again and never back: the plan ends once the grace has passed.
    p.hosts[1].lose("gone", 40.0);
    assert!(!p.settle_after(49.0, 10.0));
    assert!(!p.hosts[1].awaits_return(50.0, 10.0));
    assert!(p.settle_after(50.0, 10.0));
    assert_eq!(p.state, PlanState::Partial);
    // No grace: at once.
    let mut p = plan(&[Done, Receiving]);
    p.hosts[1].lose("gone", 20.0);
    assert!(p.settle(20.0));
}

#[test]
fn a_plan_settles_when_no_receiver_is_active() {
    use ReceiverState::*;
    let mut p = plan(&[Done, Receiving]);
    assert!(!p.settle(11.0));
    assert!(p.running());
    p.hosts[1].state = Lost;
    assert!(p.settle(12.0));
    assert_eq!(p.state, PlanState::Partial);
    assert_eq!(p.message, "finished without h1: see their errors");
    assert_eq!(p.elapsed_s(100.0), 2.0);
    // Recovered later: done, the note goes, the end time stays.
    p.hosts[1].state = Done;
    assert!(!p.settle(20.0));
    assert_eq!(p.state, PlanState::Done);
    assert_eq!((p.message.as_str(), p.ended_at), ("", Some(12.0)));
    // A failed receiver beside a local one: partial as well.
    let mut p = plan(&[Local, Failed]);
    assert!(p.settle(11.0));
    assert_eq!(p.state, PlanState::Partial);

    let mut p = plan(&[Failed, Lost]);
    assert!(p.settle(11.0));
    assert_eq!(p.state, PlanState::Failed);
    let mut p = plan(&[Local]);
    assert!(p.settle(11.0));
    assert_eq!(p.state, PlanState::Done);
}

#[test]
fn stored_plans_carry_their_version() {
    let p = plan(&[ReceiverState::Pending]);
    let json = serde_json::to_string(&StoredPlan::from(p.clone())).unwrap();
    assert_eq!(json, serde_json::to_string(&StoredPlanRef::V1(&p)).unwrap());
    assert!(json.starts_with("{\"version\":\"1\""), "{json}");
    let back: StoredPlan = serde_json::from_str(&json).unwrap();
    assert_eq!(back.into_plan(), p);
    let unknown = json.replacen("\"1\"", "\"99\"", 1);
    assert!(serde_json::from_str::<StoredPlan>(&unknown).is_err());
}
