//! Actions: `shadow` rules only report, `degrade` rules mark the request as
//! limited, and `reject` rules beside them are still charged.

use std::sync::{Arc, Mutex};

use http::StatusCode;
use spillway::algorithm::TokenBucket;
use spillway::{Decision, Quota};
use spillway_tower::{Action, HttpRule, Observer, Policy, RuleOutcome, X_SPILLWAY_LIMITED};

use crate::support::{
    admitted, app, applied_rules, body_string, bucket, header, header_u64, memory_layer, nz, req,
    send,
};

/// One observation: rule, outcome, remaining.
type Seen = (String, RuleOutcome, Option<u64>);

/// Every (rule, outcome, remaining) the layer reported, in order.
#[derive(Debug, Clone, Default)]
struct Recorder(Arc<Mutex<Vec<Seen>>>);

impl Recorder {
    fn take(&self) -> Vec<Seen> {
        std::mem::take(&mut *self.0.lock().expect("not poisoned"))
    }
}

impl Observer for Recorder {
    fn observe(&self, rule: &str, outcome: RuleOutcome, decision: Option<&Decision>) {
        self.0.lock().expect("not poisoned").push((
            rule.to_string(),
            outcome,
            decision.map(|d| d.remaining),
        ));
    }
}

#[tokio::test(start_paused = true)]
async fn shadow_rules_decide_and_report_but_let_requests_through() {
    let main = 10u64;
    // One request a second, in shadow; the real limit beside it.
    let per_second = Quota::per_second(nz(1));
    let interval = per_second.period() / per_second.limit().get();
    let policy = Policy::new([
        HttpRule::new("trial", TokenBucket::new(per_second, nz(1))).action(Action::Shadow),
        HttpRule::new("main", bucket(main as u32)),
    ]);
    let recorder = Recorder::default();
    let app = app(memory_layer(policy).observer(recorder.clone()));

    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        recorder.take(),
        [
            ("trial".into(), RuleOutcome::Allowed, Some(0)),
            ("main".into(), RuleOutcome::Allowed, Some(main - 1))
        ]
    );
    for k in 2..=4u64 {
        let res = send(&app, req("/", "192.0.2.1")).await;
        assert_eq!(
            res.status(),
            StatusCode::OK,
            "a shadow denial lets the request through"
        );
        assert_eq!(
            header(&res, X_SPILLWAY_LIMITED),
            None,
            "and does not mark it"
        );
        // The headers are there, and report the shadow rule's state.
        assert_eq!(applied_rules(&res), ["trial", "main"]);
        assert_eq!(header_u64(&res, "x-ratelimit-remaining"), 0);
        assert_eq!(header_u64(&res, "x-ratelimit-limit"), 1);
        assert_eq!(body_string(res).await, "limited=-;header=-");
        // The reject rule beside it was charged for the request.
        assert_eq!(
            recorder.take(),
            [
                ("trial".into(), RuleOutcome::Shadowed, Some(0)),
                ("main".into(), RuleOutcome::Allowed, Some(main - k))
            ]
        );
    }
    // The shadow rule was not charged for the requests it denied: one
    // interval later it admits again (it would still be in debt otherwise).
    tokio::time::advance(interval).await;
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        recorder.take(),
        [
            ("trial".into(), RuleOutcome::Allowed, Some(0)),
            ("main".into(), RuleOutcome::Allowed, Some(main - 5))
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_reject_rule_still_rejects_beside_a_shadow_rule() {
    let main = 3u32;
    let policy = Policy::new([
        HttpRule::new("trial", bucket(1)).action(Action::Shadow),
        HttpRule::new("main", bucket(main)),
    ]);
    let app = app(memory_layer(policy));
    assert_eq!(
        admitted(&app, 10, || req("/", "192.0.2.1")).await,
        main as usize
    );
}

#[tokio::test(start_paused = true)]
async fn degrade_rules_mark_the_request_for_the_handler() {
    let policy = Policy::new([HttpRule::new("cheap", bucket(1)).action(Action::Degrade)]);
    let recorder = Recorder::default();
    let app = app(memory_layer(policy).observer(recorder.clone()));

    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(header(&res, X_SPILLWAY_LIMITED), None);
    assert_eq!(body_string(res).await, "limited=-;header=-");
    assert_eq!(recorder.take()[0].1, RuleOutcome::Allowed);

    for _ in 0..2 {
        let res = send(&app, req("/", "192.0.2.1")).await;
        assert_eq!(
            res.status(),
            StatusCode::OK,
            "a degraded request goes through"
        );
        assert_eq!(header(&res, X_SPILLWAY_LIMITED).as_deref(), Some("cheap"));
        assert_eq!(header_u64(&res, "x-ratelimit-remaining"), 0);
        // The handler saw the `Limited` extension and the request header.
        assert_eq!(body_string(res).await, "limited=cheap;header=cheap");
        assert_eq!(
            recorder.take(),
            [("cheap".into(), RuleOutcome::Degraded, Some(0))]
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_client_cannot_mark_its_own_request_as_limited() {
    let policy = Policy::new([HttpRule::new("cheap", bucket(5)).action(Action::Degrade)]);
    let app = app(memory_layer(policy));
    let forged = req("/", "192.0.2.1").header(X_SPILLWAY_LIMITED, "cheap");
    let res = send(&app, forged).await;
    assert_eq!(header(&res, X_SPILLWAY_LIMITED), None);
    // The handler saw neither the extension nor the forged header.
    assert_eq!(body_string(res).await, "limited=-;header=-");
}

/// A request that no rule matches once kept the client's mark: the
/// application took it for one over its limit.
#[tokio::test(start_paused = true)]
async fn a_client_cannot_mark_a_request_that_no_rule_matches() {
    let policy = Policy::new([HttpRule::new("login", bucket(5))
        .path("/login")
        .action(Action::Degrade)]);
    let app = app(memory_layer(policy));
    let forged = req("/other", "192.0.2.1").header(X_SPILLWAY_LIMITED, "login");
    let res = send(&app, forged).await;
    assert_eq!(header(&res, X_SPILLWAY_LIMITED), None);
    assert_eq!(body_string(res).await, "limited=-;header=-");
}

#[tokio::test(start_paused = true)]
async fn a_reject_rule_beside_a_degrade_rule_is_charged_and_rejects() {
    let main = 3u32;
    let policy = Policy::new([
        HttpRule::new("cheap", bucket(1)).action(Action::Degrade),
        HttpRule::new("main", bucket(main)),
    ]);
    let app = app(memory_layer(policy));
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(body_string(res).await, "limited=-;header=-");
    for _ in 1..main {
        let res = send(&app, req("/", "192.0.2.1")).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(body_string(res).await, "limited=cheap;header=cheap");
    }
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&res, X_SPILLWAY_LIMITED), None);
}

#[tokio::test(start_paused = true)]
async fn the_observer_sees_rejections() {
    let policy = Policy::new([HttpRule::new("per-ip", bucket(1))]);
    let recorder = Recorder::default();
    let app = app(memory_layer(policy).observer(recorder.clone()));
    send(&app, req("/", "192.0.2.1")).await;
    send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(
        recorder.take(),
        [
            ("per-ip".into(), RuleOutcome::Allowed, Some(0)),
            ("per-ip".into(), RuleOutcome::Rejected, Some(0))
        ]
    );
}

/// A request a layer in front let through limited, and that this layer
/// admits at once, keeps the front layer's mark: the handler sees it, and
/// so does the client.
#[tokio::test(start_paused = true)]
async fn a_front_layers_mark_passes_a_layer_that_admits_the_request() {
    let front = Policy::new([HttpRule::new("cheap", bucket(1)).action(Action::Degrade)]);
    let behind = Policy::new([HttpRule::new("per-ip", bucket(100))]);
    let layers = tower::ServiceBuilder::new()
        .layer(memory_layer(front))
        .layer(memory_layer(behind));
    let app = app(layers);
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(header(&res, X_SPILLWAY_LIMITED), None);
    assert_eq!(body_string(res).await, "limited=-;header=-");
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(header(&res, X_SPILLWAY_LIMITED).as_deref(), Some("cheap"));
    assert_eq!(body_string(res).await, "limited=cheap;header=cheap");
}
