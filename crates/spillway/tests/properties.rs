//! Property tests of the core crate: the five algorithms against their
//! definitions in `docs/algorithms.md` and against independent models, and
//! the in-memory store against the pure algorithms.
//!
//! Limits and windows are small, and the generated gaps between requests
//! cluster around the algorithm's own time scale, so that random traffic
//! reaches the boundaries often. Failures are saved in
//! `properties.proptest-regressions` beside this file, which is committed
//! so that every later run replays them first.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use spillway::algorithm::{
    Algorithm, AnyAlgorithm, AnyState, Charged, Concurrency, FixedWindow, LeakyBucket, LeakyMode,
    SlidingLog, SlidingWindow, TokenBucket,
};
use spillway::clock::{Clock, FakeClock};
use spillway::store::{Check, MemoryOptions, MemoryStore, RateLimiter, Rule, RuleId, SharedState};
use spillway::{CostTooLarge, Decision, Error, Quota};

/// Relative to the package root, where `cargo test` runs the tests.
const REGRESSIONS: &str = "tests/properties.proptest-regressions";

/// A start time of the order of today's Unix time in microseconds, so that
/// the 128-bit arithmetic meets realistic magnitudes.
const EPOCH: u64 = 1_700_000_000_123_457;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(REGRESSIONS))),
        ..ProptestConfig::default()
    }
}

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("nonzero")
}

fn us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).expect("durations here fit in u64")
}

/// A request of cost 0 on a copy of the state: what the key looks like now.
fn peek<A: Algorithm>(alg: &A, state: &A::State, now: u64) -> Decision {
    alg.check(&mut state.clone(), 0, now)
        .expect("cost 0 always fits")
}

// ---------------------------------------------------------------------------
// Strategies

/// Small limits, and periods from 1 µs to a second: some whose emission
/// interval `period / limit` is whole, many where it is a fraction.
fn quota() -> impl Strategy<Value = Quota> {
    let limit = prop_oneof![4 => 1u32..=6, 1 => 7u32..=40];
    let period = prop_oneof![3 => 1u64..=64, 3 => 65u64..=5_000, 1 => Just(1_000_000u64)];
    (limit, period)
        .prop_map(|(l, p)| Quota::new(nz(l), Duration::from_micros(p)).expect("valid period"))
}

fn capacity() -> impl Strategy<Value = NonZeroU32> {
    prop_oneof![3 => 1u32..=6, 1 => 7u32..=30].prop_map(nz)
}

fn fixed_window() -> impl Strategy<Value = FixedWindow> {
    quota().prop_map(FixedWindow::new)
}

fn sliding_log() -> impl Strategy<Value = SlidingLog> {
    quota().prop_map(SlidingLog::new)
}

fn sliding_window() -> impl Strategy<Value = SlidingWindow> {
    quota().prop_map(SlidingWindow::new)
}

fn token_bucket() -> impl Strategy<Value = TokenBucket> {
    (quota(), capacity()).prop_map(|(q, b)| TokenBucket::new(q, b))
}

/// A shaping bucket, half of them with nginx's `delay = n`.
fn leaky_shape() -> impl Strategy<Value = LeakyBucket> {
    let undelayed = prop_oneof![Just(0u32), 0u32..=8];
    (quota(), capacity(), undelayed).prop_map(|(q, c, n)| LeakyBucket::shape(q, c).with_delay(n))
}

fn leaky_police() -> impl Strategy<Value = LeakyBucket> {
    (quota(), capacity()).prop_map(|(q, c)| LeakyBucket::police(q, c))
}

fn concurrency() -> impl Strategy<Value = Concurrency> {
    quota().prop_map(Concurrency::new)
}

fn any_algorithm() -> impl Strategy<Value = AnyAlgorithm> {
    prop_oneof![
        concurrency().prop_map(AnyAlgorithm::from),
        fixed_window().prop_map(AnyAlgorithm::from),
        sliding_log().prop_map(AnyAlgorithm::from),
        sliding_window().prop_map(AnyAlgorithm::from),
        token_bucket().prop_map(AnyAlgorithm::from),
        leaky_shape().prop_map(AnyAlgorithm::from),
        leaky_police().prop_map(AnyAlgorithm::from),
    ]
}

/// The time over which the algorithm goes from empty to full: the window,
/// or the time to refill a whole bucket (`capacity * period / limit`, which
/// for the windows is the window itself).
fn scale<A: Algorithm>(alg: &A) -> u64 {
    let q = alg.quota();
    (alg.capacity() * q.period_micros() / u64::from(q.limit().get())).max(1)
}

/// Gaps between requests: many zero (same microsecond), many short, some
/// exactly one scale (a window edge), and with `backwards` some negative
/// (a clock set back).
fn delta(scale: u64, backwards: bool) -> BoxedStrategy<i64> {
    let s = i64::try_from(scale).expect("small scale");
    let forward = prop_oneof![
        3 => Just(0i64),
        1 => Just(1i64),
        3 => 0..=(s / 4).max(1),
        2 => 0..=2 * s,
        1 => Just(s),
        1 => Just(s - 1),
    ];
    if backwards {
        prop_oneof![4 => forward, 1 => -2 * s..0].boxed()
    } else {
        forward.boxed()
    }
}

fn cost(cap: u64) -> impl Strategy<Value = u64> {
    prop_oneof![3 => 1..=cap.min(2), 2 => 0..=cap, 1 => Just(cap)]
}

fn start(scale: u64) -> impl Strategy<Value = u64> {
    prop_oneof![0..=3 * scale, EPOCH..=EPOCH + 3 * scale]
}

/// Requests as (gap since the previous one in µs, cost).
type Ops = Vec<(i64, u64)>;

/// An algorithm, a start time and a sequence of requests.
fn scenario<A: Algorithm>(
    alg: impl Strategy<Value = A>,
    max_len: usize,
    backwards: bool,
) -> impl Strategy<Value = (A, u64, Ops)> {
    alg.prop_flat_map(move |a| {
        let s = scale(&a);
        let ops = vec((delta(s, backwards), cost(a.capacity())), 1..max_len);
        (Just(a), start(s), ops)
    })
}

/// The absolute times of a scenario's requests. A negative gap sets the
/// clock back (never below zero).
fn timeline(start: u64, ops: &[(i64, u64)]) -> Vec<(u64, u64)> {
    let mut t = start;
    ops.iter()
        .map(|&(dt, cost)| {
            t = t.saturating_add_signed(dt);
            (t, cost)
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Independent models

/// A continuous token bucket in exact rationals: `tokens / period` tokens,
/// refilled by `limit` per microsecond in those units, capped at `burst`.
/// Time only moves forward here.
struct ContinuousBucket {
    burst: u128,
    limit: u128,
    period: u128,
    tokens: u128,
    last: u64,
}

impl ContinuousBucket {
    fn new(quota: Quota, burst: u64) -> Self {
        let period = u128::from(quota.period_micros());
        Self {
            burst: u128::from(burst),
            limit: u128::from(quota.limit().get()),
            period,
            tokens: u128::from(burst) * period,
            last: 0,
        }
    }

    fn check(&mut self, cost: u64, now: u64) -> Decision {
        assert!(now >= self.last, "the model only moves forward");
        let full = self.burst * self.period;
        self.tokens = (self.tokens + self.limit * u128::from(now - self.last)).min(full);
        self.last = now;
        let need = u128::from(cost) * self.period;
        let allowed = self.tokens >= need;
        if allowed {
            self.tokens -= need;
        }
        let micros = |v: u128| Duration::from_micros(u64::try_from(v).expect("small"));
        let remaining = self.tokens / self.period;
        // The next whole token, unless the bucket is full.
        let next = if remaining < self.burst {
            micros(((remaining + 1) * self.period - self.tokens).div_ceil(self.limit))
        } else {
            Duration::ZERO
        };
        Decision {
            allowed,
            limit: u64::try_from(self.burst).expect("small"),
            remaining: u64::try_from(remaining).expect("small"),
            reset_after: micros((full - self.tokens).div_ceil(self.limit)),
            refill_after: next,
            retry_after: (!allowed).then(|| micros((need - self.tokens).div_ceil(self.limit))),
            delay: Duration::ZERO,
        }
    }
}

/// A leaky bucket's queue in units of `1 / limit` µs (one unit of cost is
/// `period` of them), with nginx's `delay = n`. Time only moves forward.
struct Queue {
    limit: u128,
    period: u128,
    capacity: u128,
    undelayed: u128,
    drains_at: u128,
}

impl Queue {
    fn new(quota: Quota, capacity: u64, undelayed: u32) -> Self {
        Self {
            limit: u128::from(quota.limit().get()),
            period: u128::from(quota.period_micros()),
            capacity: u128::from(capacity),
            undelayed: u128::from(undelayed),
            drains_at: 0,
        }
    }

    /// Whether the request is admitted, and its delay in µs.
    fn check(&mut self, cost: u64, now: u64) -> (bool, u64) {
        let now = u128::from(now) * self.limit;
        let start = self.drains_at.max(now);
        let backlog = start - now;
        let size = u128::from(cost) * self.period;
        if backlog + size > self.capacity * self.period {
            return (false, 0);
        }
        if cost > 0 {
            self.drains_at = start + size;
        }
        let waits = backlog.saturating_sub(self.undelayed * self.period);
        let delay = if cost > 0 {
            waits.div_ceil(self.limit)
        } else {
            0
        };
        (true, u64::try_from(delay).expect("small"))
    }
}

// ---------------------------------------------------------------------------
// Per-algorithm invariants

proptest! {
    #![proptest_config(config(384))]

    /// 1. The sliding log admits exactly by its definition (the cost in
    /// `(t - W, t]` plus the request fits), so no window of length `W`,
    /// wherever it is placed, holds more than the limit.
    #[test]
    fn sliding_log_never_admits_more_than_the_limit_in_any_window(
        (alg, start, ops) in scenario(sliding_log(), 120, false)
    ) {
        let (limit, w) = (alg.capacity(), alg.quota().period_micros());
        let mut state = Default::default();
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        for (t, cost) in timeline(start, &ops) {
            let in_window: u64 = admitted.iter().filter(|e| e.0 + w > t).map(|e| e.1).sum();
            let d = alg.check(&mut state, cost, t).unwrap();
            prop_assert_eq!(d.allowed, in_window + cost <= limit, "t={} cost={}", t, cost);
            if d.allowed && cost > 0 {
                admitted.push((t, cost));
            }
        }
        // The fullest window ends at an admission.
        for &(end, _) in &admitted {
            let sum: u64 = admitted
                .iter()
                .filter(|e| e.0 <= end && e.0 + w > end)
                .map(|e| e.1)
                .sum();
            prop_assert!(sum <= limit, "{} admitted in the window ending at {}", sum, end);
        }
    }

    /// 2. The fixed window admits by its definition, so no aligned window
    /// `[kW, (k+1)W)` holds more than the limit.
    #[test]
    fn fixed_window_never_admits_more_than_the_limit_per_aligned_window(
        (alg, start, ops) in scenario(fixed_window(), 120, false)
    ) {
        let (limit, w) = (alg.capacity(), alg.quota().period_micros());
        let mut state = Default::default();
        let mut per_window: BTreeMap<u64, u64> = BTreeMap::new();
        for (t, cost) in timeline(start, &ops) {
            let used = per_window.get(&(t / w)).copied().unwrap_or(0);
            let d = alg.check(&mut state, cost, t).unwrap();
            prop_assert_eq!(d.allowed, used + cost <= limit, "t={} cost={}", t, cost);
            if d.allowed {
                *per_window.entry(t / w).or_default() += cost;
            }
        }
        for (k, sum) in per_window {
            prop_assert!(sum <= limit, "{} admitted in window {}", sum, k);
        }
    }

    /// 3. Over any interval `[t1, t2]` the token bucket admits at most
    /// `burst + rate * (t2 - t1)`, and every decision (every field) is the
    /// continuous bucket's: GCRA is that bucket, exactly.
    #[test]
    fn token_bucket_is_the_continuous_bucket(
        (alg, start, ops) in scenario(token_bucket(), 120, false)
    ) {
        let q = alg.quota();
        let (limit, period) = (u128::from(q.limit().get()), u128::from(q.period_micros()));
        let burst = u128::from(alg.capacity());
        let mut model = ContinuousBucket::new(q, alg.capacity());
        let mut state = Default::default();
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        for (t, cost) in timeline(start, &ops) {
            let d = alg.check(&mut state, cost, t).unwrap();
            prop_assert_eq!(d, model.check(cost, t), "t={} cost={}", t, cost);
            if d.allowed && cost > 0 {
                admitted.push((t, cost));
            }
        }
        for &(t1, _) in &admitted {
            for &(t2, _) in admitted.iter().filter(|e| e.0 >= t1) {
                let sum: u64 = admitted
                    .iter()
                    .filter(|e| (t1..=t2).contains(&e.0))
                    .map(|e| e.1)
                    .sum();
                prop_assert!(
                    u128::from(sum) * period <= burst * period + limit * u128::from(t2 - t1),
                    "{} admitted in [{}, {}]", sum, t1, t2
                );
            }
        }
    }

    /// 4a. A shaping leaky bucket delays each request by exactly the backlog
    /// in front of it (less nginx's `delay = n` units), rounded up. Without
    /// `delay = n`, departures never go backwards and are spaced by the
    /// cost of the request in front: the exact departures are at least
    /// `c * P / L` apart, and rounding each up to the µs moves it by less
    /// than 1 µs, so `gap > c * P / L - 1`, i.e. `(gap + 1) * L > c * P`.
    #[test]
    fn leaky_bucket_shapes_departures(
        (alg, start, ops) in scenario(leaky_shape(), 120, false)
    ) {
        let q = alg.quota();
        let (limit, period) = (u128::from(q.limit().get()), u128::from(q.period_micros()));
        let mut model = Queue::new(q, alg.capacity(), alg.undelayed());
        let mut state = Default::default();
        let mut last: Option<(u64, u64)> = None;
        for (t, cost) in timeline(start, &ops) {
            let d = alg.check(&mut state, cost, t).unwrap();
            prop_assert_eq!((d.allowed, us(d.delay)), model.check(cost, t), "t={} cost={}", t, cost);
            if !d.allowed || cost == 0 || alg.undelayed() > 0 {
                continue;
            }
            let departs = t + us(d.delay);
            if let Some((prev, prev_cost)) = last {
                prop_assert!(departs >= prev, "departs at {} after {}", departs, prev);
                prop_assert!(
                    (u128::from(departs - prev) + 1) * limit > u128::from(prev_cost) * period,
                    "departures {} and {} too close after cost {}", prev, departs, prev_cost
                );
            }
            last = Some((departs, cost));
        }
    }

    /// 4b. Police mode never delays, decides exactly like a token bucket
    /// whose burst is the capacity, and admits exactly what shape mode
    /// admits.
    #[test]
    fn leaky_bucket_police_is_a_token_bucket(
        (alg, start, ops) in scenario(leaky_police(), 120, false)
    ) {
        let cap = nz(u32::try_from(alg.capacity()).expect("small"));
        let tb = TokenBucket::new(alg.quota(), cap);
        let shape = LeakyBucket::shape(alg.quota(), cap);
        let (mut police_s, mut tb_s, mut shape_s) = Default::default();
        for (t, cost) in timeline(start, &ops) {
            let d = alg.check(&mut police_s, cost, t).unwrap();
            prop_assert_eq!(d.delay, Duration::ZERO);
            prop_assert_eq!(d, tb.check(&mut tb_s, cost, t).unwrap(), "t={} cost={}", t, cost);
            let shaped = shape.check(&mut shape_s, cost, t).unwrap();
            prop_assert_eq!(Decision { delay: Duration::ZERO, ..shaped }, d);
        }
    }
}

// ---------------------------------------------------------------------------
// Every algorithm: exact numbers, denials and peeks change nothing, refunds

/// Checks the decision contract at every step of a scenario. `probes` gives,
/// per step, a time offset and a cost used to look around the state.
fn decisions_are_exact(
    alg: &AnyAlgorithm,
    start: u64,
    ops: &[(i64, u64)],
    probes: &[(u64, u64)],
) -> Result<(), TestCaseError> {
    let cap = alg.capacity();
    let shaping = matches!(alg, AnyAlgorithm::LeakyBucket(lb) if lb.mode() == LeakyMode::Shape);
    let mut state = AnyState::default();
    let mut latest = 0;
    for (&(t, cost), &(x, probe_cost)) in timeline(start, ops).iter().zip(probes) {
        // Cost 0 peeks: allowed, nothing to wait for.
        let now = peek(alg, &state, t);
        prop_assert!(now.allowed && now.retry_after.is_none() && now.delay.is_zero());
        prop_assert_eq!(now.limit, cap);

        // `remaining` is exact: that much fits now, one more does not.
        let left = now.remaining;
        prop_assert!(left <= cap);
        if left >= 1 {
            prop_assert!(alg.check(&mut state.clone(), left, t).unwrap().allowed);
        }
        if left < cap {
            prop_assert!(!alg.check(&mut state.clone(), left + 1, t).unwrap().allowed);
        }

        // `reset_after` is exact: back to full then, not a microsecond before.
        let reset = us(now.reset_after);
        prop_assert_eq!(
            reset == 0,
            left == cap,
            "reset_after {} remaining {}",
            reset,
            left
        );
        if reset > 0 {
            let full = peek(alg, &state, t + reset);
            prop_assert_eq!((full.remaining, full.reset_after), (cap, Duration::ZERO));
            prop_assert!(peek(alg, &state, t + reset - 1).remaining < cap);
        }

        // `refill_after` is exact: one more unit fits then, not a
        // microsecond before (once `remaining` has reached the capacity
        // nothing more comes), and it is never after the full reset. Unless
        // the clock went back past the state, it is within a window, or for
        // the sliding window counter two (a unit counted in this window
        // weighs until the next one ends).
        let refill = us(now.refill_after);
        prop_assert_eq!(
            refill == 0,
            left == cap,
            "refill_after {} remaining {}",
            refill,
            left
        );
        prop_assert!(
            refill <= reset,
            "refill_after {} reset_after {}",
            refill,
            reset
        );
        let w = alg.quota().period_micros();
        let windows = if matches!(alg, AnyAlgorithm::SlidingWindow(_)) {
            2
        } else {
            1
        };
        if t >= latest {
            prop_assert!(
                refill <= windows * w,
                "refill_after {} window {} at {} in {:?}",
                refill,
                w,
                t,
                state
            );
        }
        latest = latest.max(t);
        if refill > 0 {
            prop_assert!(peek(alg, &state, t + refill).remaining > left);
            prop_assert_eq!(peek(alg, &state, t + refill - 1).remaining, left);
        }

        // Waiting never takes capacity away; a clock set back never frees any.
        prop_assert!(peek(alg, &state, t.saturating_sub(x)).remaining <= left);
        prop_assert!(peek(alg, &state, t + x).remaining >= left);

        // A cost above the capacity is an error and changes nothing.
        let too_much = cap + 1 + x % 3;
        let mut copy = state.clone();
        prop_assert_eq!(
            alg.check(&mut copy, too_much, t),
            Err(CostTooLarge {
                cost: too_much,
                capacity: cap
            })
        );
        prop_assert_eq!(&copy, &state);

        let before = state.clone();
        let d = alg.check(&mut state, cost, t).unwrap();
        prop_assert_eq!(d.limit, cap);
        if d.allowed {
            prop_assert_eq!(d.retry_after, None);
            if cost == 0 {
                prop_assert_eq!(d, now);
            }
            if !shaping {
                prop_assert_eq!(d.delay, Duration::ZERO);
            }
            // It reports the state after the charge.
            let after = peek(alg, &state, t);
            prop_assert_eq!(
                (d.remaining, d.reset_after, d.refill_after),
                (after.remaining, after.reset_after, after.refill_after)
            );
        } else {
            prop_assert!(cost > 0);
            prop_assert_eq!(d.delay, Duration::ZERO);
            // `retry_after` is exact: admitted then, denied a microsecond before.
            let r = us(d.retry_after.expect("a denial says when to retry"));
            prop_assert!(r >= 1);
            prop_assert!(
                alg.check(&mut state.clone(), cost, t + r).unwrap().allowed,
                "r={}",
                r
            );
            prop_assert!(
                !alg.check(&mut state.clone(), cost, t + r - 1)
                    .unwrap()
                    .allowed,
                "r={}",
                r
            );
            // A denial reports the state as it stands, and changes nothing.
            prop_assert_eq!(
                (d.remaining, d.reset_after, d.refill_after),
                (now.remaining, now.reset_after, now.refill_after)
            );
            prop_assert_eq!(peek(alg, &state, t), now);
            let later = t + x;
            prop_assert_eq!(
                alg.check(&mut state.clone(), probe_cost, later),
                alg.check(&mut before.clone(), probe_cost, later)
            );
        }
    }
    Ok(())
}

/// Per request, a time offset and a cost to look around the state with.
type Probes = Vec<(u64, u64)>;

fn exactness_case(backwards: bool) -> impl Strategy<Value = (AnyAlgorithm, u64, Ops, Probes)> {
    any_algorithm().prop_flat_map(move |a| {
        let (s, cap) = (scale(&a), a.capacity());
        let ops = vec((delta(s, backwards), cost(cap)), 1..50);
        let probes = vec((0..=2 * s, 0..=cap), 50);
        (Just(a), start(s), ops, probes)
    })
}

/// Runs the scenario and returns every decision; before the requests whose
/// `peek_first` flag is set, a cost-0 check is made on the same state.
fn run_with_peeks(
    alg: &AnyAlgorithm,
    start: u64,
    ops: &[(i64, u64)],
    peek_first: &[bool],
) -> Vec<Decision> {
    let mut state = AnyState::default();
    let mut out = Vec::new();
    for (&(t, cost), &p) in timeline(start, ops).iter().zip(peek_first) {
        if p {
            let d = alg.check(&mut state, 0, t).unwrap();
            assert!(d.allowed, "a peek is always allowed");
        }
        out.push(alg.check(&mut state, cost, t).unwrap());
    }
    out
}

/// Runs the scenario twice: once skipping the requests flagged `undo`, once
/// making them and refunding them at once. Every other decision, and the
/// state seen by a peek after each refund, must be the same.
fn refund_is_an_undo(
    alg: &AnyAlgorithm,
    start: u64,
    ops: &[(i64, u64)],
    undo: &[bool],
) -> Result<(), TestCaseError> {
    let (mut skipped, mut refunded) = (AnyState::default(), AnyState::default());
    for (&(t, cost), &undo) in timeline(start, ops).iter().zip(undo) {
        if undo && cost > 0 {
            let d = alg.check(&mut refunded, cost, t).unwrap();
            if d.allowed {
                alg.refund(&mut refunded, cost, t);
            }
            prop_assert_eq!(peek(alg, &refunded, t), peek(alg, &skipped, t), "t={}", t);
        } else {
            let a = alg.check(&mut skipped, cost, t);
            let b = alg.check(&mut refunded, cost, t);
            prop_assert_eq!(a, b, "t={} cost={}", t, cost);
        }
    }
    Ok(())
}

/// Runs the scenario twice: once charging the requests flagged with an
/// actual cost that cost, once charging their cost and settling it at once
/// at the actual cost (at most the cost). Every other decision, and the
/// state seen by a peek after each settle, must be the same.
fn settle_is_the_actual_charge(
    alg: &AnyAlgorithm,
    start: u64,
    ops: &[(i64, u64)],
    actual: &[Option<u64>],
) -> Result<(), TestCaseError> {
    let (mut direct, mut settled) = (AnyState::default(), AnyState::default());
    for (&(t, cost), &actual) in timeline(start, ops).iter().zip(actual) {
        match actual {
            Some(seed) if cost > 0 => {
                let actual = seed % (cost + 1);
                let d = alg.check(&mut settled, cost, t).unwrap();
                if d.allowed {
                    alg.settle(&mut settled, Charged::of(cost, t, &d), actual, t);
                    prop_assert!(alg.check(&mut direct, actual, t).unwrap().allowed);
                }
                prop_assert_eq!(peek(alg, &settled, t), peek(alg, &direct, t), "t={}", t);
            }
            _ => {
                let a = alg.check(&mut direct, cost, t);
                let b = alg.check(&mut settled, cost, t);
                prop_assert_eq!(a, b, "t={} cost={}", t, cost);
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(384))]

    /// 5. For all five algorithms: `remaining`, `reset_after` and
    /// `retry_after` are exact, a denial changes nothing, a cost above the
    /// capacity is an error, cost 0 is always allowed.
    #[test]
    fn every_decision_is_exact((alg, start, ops, probes) in exactness_case(false)) {
        decisions_are_exact(&alg, start, &ops, &probes)?;
    }

    /// 5, with a clock that sometimes goes backwards.
    #[test]
    fn every_decision_is_exact_when_the_clock_goes_back(
        (alg, start, ops, probes) in exactness_case(true)
    ) {
        decisions_are_exact(&alg, start, &ops, &probes)?;
    }

    /// 5. Peeks (cost 0) inserted anywhere change no other decision.
    #[test]
    fn peeks_change_nothing(
        (alg, start, ops) in scenario(any_algorithm(), 60, true),
        peek_first in vec(any::<bool>(), 60),
    ) {
        let plain = run_with_peeks(&alg, start, &ops, &[false; 60]);
        prop_assert_eq!(run_with_peeks(&alg, start, &ops, &peek_first), plain);
    }

    /// 6. A refund right after a charge restores an equivalent state: the
    /// same peek, and the same decisions on everything that follows.
    ///
    /// Only with a clock that moves forward: "equivalent" means "decides
    /// the same from now on". After a clock set back, two such states can
    /// differ (a full bucket whose TAT is `now` and one whose TAT is
    /// earlier), just as a forgotten idle key differs from a kept one; and
    /// a window's refund reads `charged_at` as the window charged, which a
    /// clock set back makes ambiguous. The in-memory store therefore puts
    /// states back instead of refunding (property 7 with the clock set back).
    #[test]
    fn refund_right_after_a_charge_undoes_it(
        (alg, start, ops) in scenario(any_algorithm(), 60, false),
        undo in vec(any::<bool>(), 60),
    ) {
        refund_is_an_undo(&alg, start, &ops, &undo)?;
    }

    /// 6. A settle right after a charge, at an actual cost no higher, is
    /// the charge of the actual cost: the same peek, and the same
    /// decisions on everything that follows. (A clock that moves forward,
    /// as for refunds.)
    #[test]
    fn settle_right_after_a_charge_is_the_actual_charge(
        (alg, start, ops) in scenario(any_algorithm(), 60, false),
        actual in vec(option::of(any::<u64>()), 60),
    ) {
        settle_is_the_actual_charge(&alg, start, &ops, &actual)?;
    }
}

// ---------------------------------------------------------------------------
// The in-memory store

const KEYS: [&str; 3] = ["alice", "bob", "10.0.0.1"];

/// One check of a batch: (rule, key index, cost seed). The seed is capped
/// to the rule's capacity, except `u64::MAX`, which asks for one more.
type CheckSeed = (usize, usize, u64);

/// Batches of checks, each after a gap in µs.
type Batches = Vec<(i64, Vec<CheckSeed>)>;

/// Rules, shards, sweep interval (µs), start time, batches.
type StoreCase = (Vec<AnyAlgorithm>, usize, u64, u64, Batches);

fn store_case(backwards: bool) -> impl Strategy<Value = StoreCase> {
    // With a clock set back, a key the store forgot while idle is no longer
    // the same as the model's idle state, so the model forgets as the store
    // does on every touch, and the store never sweeps behind its back.
    let sweep = if backwards {
        Just(u64::MAX).boxed()
    } else {
        (1u64..=50).boxed()
    };
    (vec(any_algorithm(), 2..=4), 1usize..=8, sweep).prop_flat_map(move |(rules, shards, sweep)| {
        let n = rules.len();
        let scales: Vec<u64> = rules.iter().map(scale).collect();
        let (lo, hi) = (scales.iter().min().copied(), scales.iter().max().copied());
        let (lo, hi) = (lo.unwrap_or(1), hi.unwrap_or(1));
        let gap = prop_oneof![delta(lo, backwards), delta(hi, backwards)];
        let seed = prop_oneof![6 => 0u64..=2, 4 => 0u64..=30, 1 => Just(u64::MAX)];
        let batch = vec((0..n, 0..KEYS.len(), seed), 1..=4);
        (
            Just(rules),
            Just(shards),
            Just(sweep),
            start(lo),
            vec((gap, batch), 1..40),
        )
    })
}

/// The pure algorithm on the model's state for `(rule, key)`, forgetting
/// the state when it is idle afterwards, as the store does with a key it
/// touches.
fn model_check<'k>(
    algs: &[AnyAlgorithm],
    model: &mut HashMap<(usize, &'k str), AnyState>,
    check: Check<'k>,
    now: u64,
) -> Decision {
    let (alg, at) = (&algs[check.rule.0], (check.rule.0, check.key));
    let state = model.entry(at).or_default();
    let decision = alg.check(state, check.cost, now).expect("fits");
    if alg.idle_at(state) <= now {
        model.remove(&at);
    }
    decision
}

fn store_is_atomic(
    algs: &[AnyAlgorithm],
    shards: usize,
    sweep: u64,
    start: u64,
    batches: &[(i64, Vec<CheckSeed>)],
) -> Result<(), TestCaseError> {
    let rules = algs
        .iter()
        .enumerate()
        .map(|(i, a)| Rule::new(format!("rule-{i}"), *a))
        .collect();
    let options = MemoryOptions {
        max_keys: NonZeroUsize::new(10_000).expect("nonzero"),
        shards: NonZeroUsize::new(shards).expect("nonzero"),
        sweep_interval: Duration::from_micros(sweep),
        ..MemoryOptions::default()
    };
    let store = MemoryStore::with_clock(rules, options, FakeClock::new(0));
    let peek_store = |rule: usize, key: &str, t: u64| {
        let check = Check {
            rule: RuleId(rule),
            key,
            cost: 0,
        };
        let v = store.check_at(&[check], t).expect("a peek always fits");
        v.decisions[0]
    };
    // The pure algorithms, one state per (rule, key).
    let mut model: HashMap<(usize, &str), AnyState> = HashMap::new();
    let mut t = start;
    for (dt, seeds) in batches {
        t = t.saturating_add_signed(*dt);
        let checks: Vec<Check<'_>> = seeds
            .iter()
            .map(|&(rule, key, seed)| {
                let cap = algs[rule].capacity();
                let cost = if seed == u64::MAX {
                    cap + 1
                } else {
                    seed.min(cap)
                };
                Check {
                    rule: RuleId(rule),
                    key: KEYS[key],
                    cost,
                }
            })
            .collect();
        let touched: BTreeSet<(usize, &str)> = checks.iter().map(|c| (c.rule.0, c.key)).collect();
        let before: Vec<Decision> = touched.iter().map(|&(r, k)| peek_store(r, k, t)).collect();
        for (&(rule, key), seen) in touched.iter().zip(&before) {
            let check = Check {
                rule: RuleId(rule),
                key,
                cost: 0,
            };
            let want = model_check(algs, &mut model, check, t);
            prop_assert_eq!(*seen, want, "store and model differ on {:?}", (rule, key));
        }
        let peeks_unchanged = |what: &str| -> Result<(), TestCaseError> {
            for (&(r, k), seen) in touched.iter().zip(&before) {
                prop_assert_eq!(
                    peek_store(r, k, t),
                    *seen,
                    "{}: {:?} was charged",
                    what,
                    (r, k)
                );
            }
            Ok(())
        };

        let verdict = store.check_at(&checks, t);
        let too_large = checks
            .iter()
            .position(|c| c.cost > algs[c.rule.0].capacity());
        let verdict = match (verdict, too_large) {
            (Err(e), Some(index)) => {
                let c = checks[index];
                let source = CostTooLarge {
                    cost: c.cost,
                    capacity: algs[c.rule.0].capacity(),
                };
                prop_assert_eq!(e, Error::CostTooLarge { index, source });
                peeks_unchanged("an error")?;
                continue;
            }
            (Ok(verdict), None) => verdict,
            (got, _) => {
                return Err(TestCaseError::fail(format!("{checks:?} gave {got:?}")));
            }
        };

        // The same checks applied one after the other to the pure algorithms.
        let mut trial = model.clone();
        let sequential: Vec<Decision> = checks
            .iter()
            .map(|&c| model_check(algs, &mut trial, c, t))
            .collect();
        prop_assert_eq!(verdict.decisions.len(), checks.len());
        prop_assert_eq!(verdict.allowed, sequential.iter().all(|d| d.allowed));
        if verdict.allowed {
            prop_assert_eq!(verdict.decisions.as_slice(), sequential.as_slice());
            model = trial;
            continue;
        }
        // Denied: nothing charged, and each rule that would have admitted
        // reports the state as it stands.
        peeks_unchanged("a denial")?;
        for (c, (got, seq)) in checks.iter().zip(verdict.decisions.iter().zip(&sequential)) {
            prop_assert_eq!(got.allowed, seq.allowed);
            if got.allowed {
                prop_assert_eq!(*got, peek_store(c.rule.0, c.key, t), "{:?}", c);
            } else {
                prop_assert_eq!(got, seq);
            }
        }
    }
    Ok(())
}

/// Runs one algorithm through a [`RateLimiter`] on a fake clock and through
/// the pure algorithm on one state per key: the decisions must agree while
/// the limiter drops idle keys (a sweep every few microseconds), and once
/// everything is idle an access empties the (single-shard) table.
fn limiter_matches_algorithm<A: Algorithm>(
    alg: A,
    start: u64,
    sweep: u64,
    ops: &[(i64, u64, u64)],
) -> Result<(), TestCaseError>
where
    A::State: SharedState,
{
    let clock = FakeClock::new(start);
    let options = MemoryOptions {
        // Fewer than 128 keys: one shard, so one access sweeps everything.
        max_keys: NonZeroUsize::new(64).expect("nonzero"),
        shards: NonZeroUsize::new(4).expect("nonzero"),
        sweep_interval: Duration::from_micros(sweep),
        ..MemoryOptions::default()
    };
    let limiter: RateLimiter<A, u64, FakeClock> =
        RateLimiter::with_options(alg.clone(), clock.clone(), options);
    let mut model: HashMap<u64, A::State> = HashMap::new();
    for &(dt, key, cost) in ops {
        clock.advance(Duration::from_micros(dt.unsigned_abs()));
        let t = clock.now();
        let want = alg.check(model.entry(key).or_default(), cost, t);
        prop_assert_eq!(limiter.check(&key, cost), want, "key {} at {}", key, t);
        // Active keys are never dropped; idle ones may linger until a sweep.
        let active = model.values().filter(|s| alg.idle_at(s) > t).count();
        prop_assert!(
            (active..=model.len()).contains(&limiter.len()),
            "{} held, {} active of {}",
            limiter.len(),
            active,
            model.len()
        );
    }
    let idle = model.values().map(|s| alg.idle_at(s)).max().unwrap_or(0);
    clock.set(idle.max(clock.now()) + sweep);
    prop_assert!(limiter.check(&0, 0).unwrap().allowed);
    prop_assert_eq!(limiter.len(), 0);
    Ok(())
}

fn limiter_case() -> impl Strategy<Value = (AnyAlgorithm, u64, u64, Vec<(i64, u64, u64)>)> {
    (any_algorithm(), 1u64..=100).prop_flat_map(|(a, sweep)| {
        let s = scale(&a);
        let ops = vec((delta(s, false), 0u64..4, cost(a.capacity())), 1..80);
        (Just(a), start(s), Just(sweep), ops)
    })
}

proptest! {
    #![proptest_config(config(256))]

    /// 7. A multi-rule check never charges a denied request, and an admitted
    /// one is charged exactly as if each check were applied in turn.
    #[test]
    fn multi_rule_check_is_atomic((algs, shards, sweep, start, batches) in store_case(false)) {
        store_is_atomic(&algs, shards, sweep, start, &batches)?;
    }

    /// 7, with a clock that sometimes goes backwards.
    #[test]
    fn multi_rule_check_is_atomic_when_the_clock_goes_back(
        (algs, shards, sweep, start, batches) in store_case(true)
    ) {
        store_is_atomic(&algs, shards, sweep, start, &batches)?;
    }

    /// 8. The limiter decides exactly like the pure algorithm, for each
    /// algorithm type and for `AnyAlgorithm`, while it forgets idle keys.
    #[test]
    fn limiter_decides_like_the_pure_algorithm((alg, start, sweep, ops) in limiter_case()) {
        limiter_matches_algorithm(alg, start, sweep, &ops)?;
        match alg {
            AnyAlgorithm::FixedWindow(a) => limiter_matches_algorithm(a, start, sweep, &ops)?,
            AnyAlgorithm::SlidingLog(a) => limiter_matches_algorithm(a, start, sweep, &ops)?,
            AnyAlgorithm::SlidingWindow(a) => limiter_matches_algorithm(a, start, sweep, &ops)?,
            AnyAlgorithm::TokenBucket(a) => limiter_matches_algorithm(a, start, sweep, &ops)?,
            AnyAlgorithm::LeakyBucket(a) => limiter_matches_algorithm(a, start, sweep, &ops)?,
            AnyAlgorithm::Concurrency(a) => limiter_matches_algorithm(a, start, sweep, &ops)?,
        }
    }
}
