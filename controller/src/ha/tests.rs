use super::view::apply;
use super::*;
use crate::plan::{PlanKind, PlanState, ReceiverProgress, ReceiverState, StoredPlanRef};
use crate::state::RedbStore;
use shardcast_placement::Tier;

fn model(name: &str, digest: &str) -> Vec<u8> {
    serde_json::to_vec(&ModelRecord {
        version: crate::core::MODEL_RECORD_VERSION.into(),
        name: name.into(),
        digest: digest.into(),
        origin: "file:///m/".into(),
        chunk_size: 1 << 20,
        total_bytes: 10,
        shards: vec![("a.safetensors".into(), 10, 1)],
        registered_at: 1.0,
        profile: None,
        read_origin: String::new(),
    })
    .unwrap()
}

fn host(id: &str) -> Vec<u8> {
    serde_json::to_vec(&StoredHost {
        version: crate::inventory::HOST_RECORD_VERSION.into(),
        host: crate::inventory::HostView {
            host_id: id.into(),
            rack: "r1".into(),
            data_addr: "127.0.0.1:1".into(),
            agent_addr: "127.0.0.1:2".into(),
            ..Default::default()
        },
        gpu_reserved: Default::default(),
        pending_evictions: Vec::new(),
    })
    .unwrap()
}

fn plan(id: &str, state: PlanState) -> (Plan, Vec<u8>) {
    let p = Plan {
        state,
        ..Plan::started(
            id,
            ("org/m", "d1"),
            Tier::Memory,
            PlanKind::Chains,
            vec![ReceiverProgress::new("h1", ReceiverState::Receiving)],
            "file:///m/",
            10.0,
        )
    };
    let bytes = serde_json::to_vec(&StoredPlanRef::V1(&p)).unwrap();
    (p, bytes)
}

fn put(table: Table, key: &str, value: Vec<u8>) -> Change {
    Change {
        table,
        key: key.into(),
        value: Some(value),
    }
}

fn del(table: Table, key: &str) -> Change {
    Change {
        table,
        key: key.into(),
        value: None,
    }
}

/// Changes applied one by one leave a view equal to a whole load of the same state.
#[tokio::test]
async fn applied_changes_match_a_whole_load() {
    let dir = tempfile::tempdir().unwrap();
    let cancel = CancellationToken::new();
    let empty: Arc<dyn StateStore> =
        Arc::new(RedbStore::open(&dir.path().join("empty.redb")).unwrap());
    let view = Services::open_read_only(&Config::default(), empty, cancel.clone()).unwrap();
    let (running, running_bytes) = plan("p1", PlanState::Running);
    let (_, p2_running) = plan("p2", PlanState::Running);
    let (p2_done, p2_done_bytes) = plan("p2", PlanState::Done);
    let steps = vec![
        vec![put(Table::Models, "org/a", model("org/a", "d0"))],
        vec![
            put(Table::Models, "org/m", model("org/m", "d1")),
            put(Table::Manifests, "d1", b"manifest".to_vec()),
        ],
        vec![
            put(Table::Hosts, "h1", host("h1")),
            put(Table::Hosts, "h2", host("h2")),
        ],
        vec![put(Table::Plans, "p1", running_bytes)],
        vec![put(Table::Plans, "p2", p2_running)],
        vec![del(Table::Models, "org/a"), del(Table::Hosts, "h2")],
        vec![put(Table::Usage, "d1", b"1234.5".to_vec())],
        vec![put(Table::Plans, "p9", b"not json".to_vec())],
    ];
    for step in steps {
        apply(&view, step);
    }
    // A watcher of a running plan follows its stored updates to the end.
    let (_, rx) = view.core.watch_plan("p2").unwrap();
    let mut rx = rx.expect("a running plan has watchers");
    apply(&view, vec![put(Table::Plans, "p2", p2_done_bytes)]);
    rx.changed().await.unwrap();
    assert_eq!(*rx.borrow_and_update(), p2_done);
    assert!(
        view.core.watch_plan("p2").unwrap().1.is_none(),
        "ended: no watchers"
    );
    assert!(view.core.watch_plan("p1").unwrap().1.is_some());

    // The same state written to a store and loaded whole.
    let full = RedbStore::open(&dir.path().join("full.redb")).unwrap();
    full.put(Table::Models, "org/m", &model("org/m", "d1"))
        .unwrap();
    full.put(Table::Manifests, "d1", b"manifest").unwrap();
    full.put(Table::Hosts, "h1", &host("h1")).unwrap();
    full.put(
        Table::Plans,
        "p1",
        &serde_json::to_vec(&StoredPlanRef::V1(&running)).unwrap(),
    )
    .unwrap();
    full.put(
        Table::Plans,
        "p2",
        &serde_json::to_vec(&StoredPlanRef::V1(&p2_done)).unwrap(),
    )
    .unwrap();
    full.put(Table::Usage, "d1", b"1234.5").unwrap();
    let loaded =
        Services::open_read_only(&Config::default(), Arc::new(full), cancel.clone()).unwrap();

    assert_eq!(view.core.list_models(), loaded.core.list_models());
    let hosts = |c: &Services| {
        c.core
            .list_hosts()
            .into_iter()
            .map(|h| (h.report, h.up, h.gpus_reserved))
            .collect::<Vec<_>>()
    };
    assert_eq!(hosts(&view), hosts(&loaded));
    let plans = |c: &Services| {
        let mut v = c.core.list_plans(Plan::clone);
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    };
    assert_eq!(plans(&view), plans(&loaded));
    assert_eq!(
        view.core.get_status("org/m").unwrap(),
        loaded.core.get_status("org/m").unwrap()
    );
    assert_eq!(view.core.usage().last("d1"), 1234.5);
    assert_eq!(
        lock(&view.core.state).receiver_plans.get("h1"),
        lock(&loaded.core.state).receiver_plans.get("h1")
    );

    // A deleted plan leaves the receiver index too.
    apply(&view, vec![del(Table::Plans, "p1")]);
    assert!(view.core.get_plan("p1").is_err());
    assert_eq!(
        lock(&view.core.state).receiver_plans.get("h1"),
        Some(&vec!["p2".to_string()])
    );
    cancel.cancel();
}

#[tokio::test]
async fn a_replica_is_ready_while_a_leader_is_known() {
    let (tx, rx) = watch::channel(Role::Follower { leader: None });
    let replica = Replica::new("r1", rx, Arc::default());
    let readiness = shardcast_identity::ready::Readiness::new();
    readiness.require(LEADER, "no leader known yet");
    let cancel = CancellationToken::new();
    let task = tokio::spawn(replica.follow_leader(readiness.clone(), cancel.clone()));
    let mut ready = readiness.subscribe();
    let settle = |ready: &mut watch::Receiver<bool>, want: bool| {
        let mut ready = ready.clone();
        async move {
            tokio::time::timeout(Duration::from_secs(5), ready.wait_for(|r| *r == want))
                .await
                .expect("readiness did not follow the role")
                .map(|_| ())
                .unwrap();
        }
    };
    // No leader: not ready, and the reason says so.
    tokio::task::yield_now().await;
    assert!(
        readiness
            .http_answer()
            .1
            .contains("leader: no leader known"),
        "{:?}",
        readiness.http_answer()
    );
    // A follower that knows the leader is ready; so is the leader.
    let leader = LeaderInfo {
        id: "r2".into(),
        grpc: "10.0.0.2:7500".into(),
        http: "10.0.0.2:7501".into(),
    };
    tx.send(Role::Follower {
        leader: Some(leader),
    })
    .unwrap();
    settle(&mut ready, true).await;
    tx.send(Role::Follower { leader: None }).unwrap();
    settle(&mut ready, false).await;
    tx.send(Role::Leader).unwrap();
    settle(&mut ready, true).await;
    cancel.cancel();
    task.await.unwrap();
}
