//! The Lua scripts: the general one, assembled from one file per algorithm
//! plus the driver that runs all the checks of a request atomically and
//! gives charges back; and, for the common request of one check, one
//! smaller script per algorithm (its file plus `single.lua`).
//!
//! Arguments of the general script, per check: the algorithm's number, five
//! parameters and the cost (see `scripts/driver.lua`); of a single-check
//! script: only the parameters its algorithm reads, then the cost. The
//! reply, either way: whether the request was admitted, the server's time,
//! then seven numbers per check.

use std::time::Duration;

use spillway::algorithm::{AnyAlgorithm, Calendar, LeakyMode};
use spillway::{Algorithm, Decision};

use crate::Error;

const COMMON: &str = include_str!("scripts/common.lua");

const DRIVER: &str = include_str!("scripts/driver.lua");

/// The general script's source. With `time_override`, the first argument
/// (when not empty) replaces the server's clock: only the test build asks
/// for that.
pub(crate) fn source(time_override: bool) -> String {
    let mut src = format!(
        "local ALLOW_TIME_OVERRIDE = {time_override}\nlocal MAX_HOLDS_PER_KEY = {}\n{COMMON}\n",
        spillway::store::MAX_HOLDS_PER_KEY
    );
    for family in &FAMILIES {
        src.push_str(family.file);
        src.push('\n');
    }
    src.push_str(DRIVER);
    src.push('\n');
    src
}

/// An algorithm's Lua.
struct Family {
    /// Its file, which defines `function`.
    file: &'static str,
    /// The function, `function(op, key, state, cost, now, p1..)`.
    function: &'static str,
    /// How many parameters it reads.
    arity: usize,
    /// Its own single-check script, if `single.lua` around the function
    /// is not the one: the fixed window's is written out in line, since
    /// its common case is two commands and the generic script's calls
    /// would cost more than they do.
    single: Option<&'static str>,
}

/// Every algorithm's Lua (the general script holds them all, in this
/// order), indexed by [`family`] for the single-check scripts.
const FAMILIES: [Family; 6] = [
    Family {
        file: include_str!("scripts/fixed_window.lua"),
        function: "fixed_window",
        arity: 2,
        single: Some(include_str!("scripts/fixed_window_single.lua")),
    },
    Family {
        file: include_str!("scripts/sliding_log.lua"),
        function: "sliding_log",
        arity: 2,
        single: None,
    },
    Family {
        file: include_str!("scripts/sliding_window.lua"),
        function: "sliding_window",
        arity: 2,
        single: None,
    },
    Family {
        file: include_str!("scripts/bucket.lua"),
        function: "bucket",
        arity: 5,
        single: None,
    },
    Family {
        file: include_str!("scripts/leases.lua"),
        function: "leases",
        arity: 2,
        single: None,
    },
    Family {
        file: include_str!("scripts/calendar_window.lua"),
        function: "calendar_window",
        arity: 5,
        single: None,
    },
];

/// How many single-check scripts there are.
pub(crate) const SINGLE_SCRIPTS: usize = FAMILIES.len();

/// Which single-check script decides a check with these parameters.
pub(crate) fn family(params: &Params) -> usize {
    match params[0] {
        1 => 0,
        2 => 1,
        3 => 2,
        CONCURRENCY => 4,
        CALENDAR => 5,
        _ => 3,
    }
}

/// The arguments a single-check script takes before the cost: the
/// parameters its algorithm reads.
pub(crate) fn single_args(params: &Params) -> &[u64] {
    &params[1..=FAMILIES[family(params)].arity]
}

/// The source of single-check script `family`; `time_override` as for
/// [`source`] (there, an argument after the cost).
pub(crate) fn single_source(family: usize, time_override: bool) -> String {
    let Family {
        file,
        function,
        arity,
        single,
    } = &FAMILIES[family];
    let arity = *arity;
    let head = format!("local ALLOW_TIME_OVERRIDE = {time_override}\n{COMMON}\n");
    if let Some(single) = single {
        return format!("{head}{single}");
    }
    let names: Vec<String> = (1..=arity).map(|i| format!("p{i}")).collect();
    let reads: Vec<String> = (1..=arity).map(|i| format!("ARGV[{i}] + 0")).collect();
    let driver = include_str!("scripts/single.lua")
        .replace(
            "-- PARAMS_FROM_ARGV",
            &format!("local {} = {}", names.join(", "), reads.join(", ")),
        )
        .replace("ALGORITHM", function)
        .replace("ARITY + 1", &(arity + 1).to_string())
        .replace("ARITY + 2", &(arity + 2).to_string())
        .replace("PARAMS", &names.join(", "));
    format!("{head}{file}\n{driver}")
}

/// Lua numbers are doubles: every intermediate value must stay below 2^53.
const EXACT: u128 = 1 << 53;

/// The largest limit of a sliding log on Redis. The log keeps one entry per
/// admitted request (those of one microsecond merged), and a check walks
/// every entry that expired since the last one, inside one script, while
/// Redis serves nobody else: 10,000 entries take about 10 to 20 ms (more
/// on a loaded machine), once per window at most.
pub const MAX_SLIDING_LOG_LIMIT: u32 = 10_000;

/// The most slots a concurrency rule takes on Redis: each slot held is a
/// member of its key's sorted set, and a lease's slots are written one
/// command each.
pub const MAX_CONCURRENCY_SLOTS: u32 = 100_000;

/// A concurrency rule's algorithm number in a script call.
pub(crate) const CONCURRENCY: u64 = 6;

/// A calendar window's algorithm number in a script call: its parameters
/// after the limit are the periods around the time of the call
/// ([`calendar_params`]), filled in for each call.
pub(crate) const CALENDAR: u64 = 7;

/// A calendar window's parameters at `now` (µs): the limit, the index of
/// the period before now's, and the first instants of the three periods
/// from now's on, so that a server whose clock is anywhere within a period
/// of `now` finds its period and that period's end among them.
pub(crate) fn calendar_params(limit: u64, calendar: &Calendar, now: u64) -> Params {
    let k0 = calendar.index(now).saturating_sub(1);
    [
        CALENDAR,
        limit,
        k0,
        calendar.start(k0 + 1),
        calendar.start(k0 + 2),
        calendar.start(k0 + 3),
    ]
}

/// The seven numbers a check sends, less the cost: algorithm, p1..p5.
pub(crate) type Params = [u64; 6];

/// Encodes a rule's algorithm for the script, refusing configurations whose
/// arithmetic would not be exact in Lua.
pub(crate) fn params(rule: &str, algorithm: &AnyAlgorithm) -> Result<Params, Error> {
    let too_large = |reason| Error::Rule {
        rule: rule.to_string(),
        reason,
    };
    let quota = algorithm.quota();
    let limit = u64::from(quota.limit().get());
    let window = quota.period_micros();
    // The fixed window and the sliding log only add and compare times and
    // counts: a time a window or two past now must stay exact. The sliding
    // window (the counter) weighs the previous count by the time left,
    // `limit x window` at most.
    let windowed = |id, weighs: bool| {
        if 4 * u128::from(window) >= EXACT {
            return Err(too_large(
                "a window must stay below 2^51 µs (71 years) for exact Lua arithmetic",
            ));
        }
        if weighs && 2 * u128::from(limit) * u128::from(window) >= EXACT {
            return Err(too_large(
                "limit x window must stay below 2^52 for exact Lua arithmetic in a \
                 sliding window; a fixed window or a sliding log has no such bound",
            ));
        }
        Ok([id, limit, window, 0, 0, 0])
    };
    let bucket = |id, mode, undelayed: u64| {
        let interval = quota.emission_interval();
        let capacity = algorithm.capacity();
        let span =
            2 * u128::from(capacity) * u128::from(interval.micros) + u128::from(interval.per);
        if span >= EXACT {
            return Err(too_large(
                "capacity x period / limit is too large for exact Lua arithmetic",
            ));
        }
        Ok([id, capacity, interval.micros, interval.per, mode, undelayed])
    };
    match algorithm {
        // The periods are filled in for each call.
        AnyAlgorithm::FixedWindow(fw) if fw.calendar_of().is_some() => {
            Ok([CALENDAR, limit, 0, 0, 0, 0])
        }
        AnyAlgorithm::FixedWindow(_) => windowed(1, false),
        AnyAlgorithm::SlidingLog(_) if quota.limit().get() > MAX_SLIDING_LOG_LIMIT => {
            Err(too_large(
                "a sliding log on Redis takes a limit of 10,000 at most (it keeps an entry \
                 per admitted request, and one script walks what expired while Redis waits); \
                 use a sliding window for a larger limit",
            ))
        }
        AnyAlgorithm::SlidingLog(_) => windowed(2, false),
        AnyAlgorithm::Concurrency(_) if quota.limit().get() > MAX_CONCURRENCY_SLOTS => {
            Err(too_large(
                "a concurrency rule on Redis takes 100,000 slots at most (a slot held is a \
                 member of the key's sorted set)",
            ))
        }
        AnyAlgorithm::Concurrency(_) => windowed(CONCURRENCY, false),
        AnyAlgorithm::SlidingWindow(_) => windowed(3, true),
        AnyAlgorithm::TokenBucket(_) => bucket(4, 0, 0),
        AnyAlgorithm::LeakyBucket(lb) => match lb.mode() {
            LeakyMode::Shape => bucket(5, 1, u64::from(lb.undelayed())),
            LeakyMode::Police => bucket(5, 2, 0),
        },
    }
}

/// The reply, decoded: admitted, the server's time (µs), one decision per
/// check.
pub(crate) fn decode(reply: &[i64], checks: usize) -> Result<(bool, u64, Vec<Decision>), Error> {
    if reply.len() != 2 + 7 * checks {
        return Err(Error::Reply(format!(
            "{} numbers for {checks} checks",
            reply.len()
        )));
    }
    let micros = |v: i64| Duration::from_micros(v.max(0) as u64);
    let decisions = reply[2..]
        .chunks_exact(7)
        .map(|d| Decision {
            allowed: d[0] == 1,
            limit: d[1].max(0) as u64,
            remaining: d[2].max(0) as u64,
            reset_after: micros(d[3]),
            refill_after: micros(d[4]),
            retry_after: (d[5] >= 0).then(|| micros(d[5])),
            delay: micros(d[6]),
        })
        .collect();
    Ok((reply[0] == 1, reply[1].max(0) as u64, decisions))
}

/// Per renewed lease: whether it was still held, and the time it now runs
/// from.
pub(crate) type LeaseRenewed = (bool, u64);

/// A renew's reply split: the reply of a decision (admitted, the time,
/// seven numbers per check), then per check whether its lease was still
/// held (0/1) and the time it now runs from.
pub(crate) fn split_renewed(
    reply: &[i64],
    checks: usize,
) -> Result<(&[i64], Vec<LeaseRenewed>), Error> {
    let head = 2 + 7 * checks;
    if reply.len() != head + 2 * checks {
        return Err(Error::Reply(format!(
            "{} numbers for {checks} renews",
            reply.len()
        )));
    }
    let renewed = reply[head..]
        .chunks_exact(2)
        .map(|r| (r[0] == 1, r[1].max(0) as u64))
        .collect();
    Ok((&reply[..head], renewed))
}

/// The Redis key of `key` under `rule`: `prefix{rule:key}:algorithm`,
/// escaped so that two different (rule, key) pairs never meet, hash-tagged
/// so that a key's state stays in one cluster slot, and suffixed with the
/// algorithm so that a reload that changes a rule's algorithm starts it
/// afresh instead of misreading the old state.
pub(crate) fn redis_key(prefix: &str, rule: &str, algorithm: &AnyAlgorithm, key: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + rule.len() + key.len() + 4);
    out.push_str(prefix);
    out.push('{');
    escape_into(&mut out, rule);
    out.push(':');
    escape_into(&mut out, key);
    out.push_str("}:");
    // The windows' state counts windows by number, which means nothing
    // under another window length: their suffix names the length, so a
    // reload that changes it starts afresh instead of misreading the count.
    // The other states are times and counts, kept across any change.
    let window = |tag: &str, out: &mut String| {
        out.push_str(tag);
        out.push(':');
        out.push_str(itoa::Buffer::new().format(algorithm.quota().period_micros()));
    };
    match algorithm {
        // A period's index means nothing under another period or zone.
        AnyAlgorithm::FixedWindow(fw) if let Some(c) = fw.calendar_of() => {
            out.push_str("fwc:");
            out.push_str(c.period().name());
            out.push(':');
            out.push_str(c.zone().name());
        }
        AnyAlgorithm::FixedWindow(_) => window("fwi", &mut out),
        AnyAlgorithm::SlidingWindow(_) => window("sw", &mut out),
        AnyAlgorithm::SlidingLog(_) => out.push_str("sl"),
        // A sorted set: not the hash the first concurrency rules kept
        // under "cc".
        AnyAlgorithm::Concurrency(_) => out.push_str("ls"),
        AnyAlgorithm::TokenBucket(_) => out.push_str("tb"),
        AnyAlgorithm::LeakyBucket(_) => out.push_str("lb"),
    }
    out
}

pub(crate) fn escape_into(out: &mut String, s: &str) {
    for ch in s.chars() {
        match ch {
            '%' => out.push_str("%25"),
            ':' => out.push_str("%3A"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            _ => out.push(ch),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_never_collide_and_stay_in_one_slot() {
        use spillway::Quota;
        use spillway::algorithm::FixedWindow;
        let fw = AnyAlgorithm::from(FixedWindow::new(Quota::per_second(
            std::num::NonZeroU32::MIN,
        )));
        assert_eq!(redis_key("s:", "a:b", &fw, "c"), "s:{a%3Ab:c}:fwi:1000000");
        assert_eq!(redis_key("s:", "a", &fw, "b:c"), "s:{a:b%3Ac}:fwi:1000000");
        assert_eq!(redis_key("s:", "r", &fw, "}{"), "s:{r:%7D%7B}:fwi:1000000");
    }

    #[test]
    fn only_the_sliding_window_bounds_limit_times_window() {
        use spillway::Quota;
        use spillway::algorithm::{FixedWindow, SlidingLog, SlidingWindow};
        let day = std::time::Duration::from_secs(86_400);
        let big = Quota::new(std::num::NonZeroU32::new(1_000_000).expect("nonzero"), day)
            .expect("a quota");
        assert!(params("fw", &FixedWindow::new(big).into()).is_ok());
        let log =
            Quota::new(std::num::NonZeroU32::new(10_000).expect("nonzero"), day).expect("a quota");
        assert!(params("sl", &SlidingLog::new(log).into()).is_ok());
        let refused = params("sw", &SlidingWindow::new(big).into()).expect_err("too large");
        assert!(refused.to_string().contains("sw"), "{refused}");
        let small =
            Quota::new(std::num::NonZeroU32::new(50_000).expect("nonzero"), day).expect("a quota");
        assert!(params("sw", &SlidingWindow::new(small).into()).is_ok());
    }

    #[test]
    fn a_concurrency_rule_takes_a_hundred_thousand_slots_at_most() {
        use spillway::Quota;
        use spillway::algorithm::Concurrency;
        let of = |n| {
            let quota = Quota::per_minute(std::num::NonZeroU32::new(n).expect("nonzero"));
            params("exports", &Concurrency::new(quota).into())
        };
        // Past the sliding log's bound: leases are no log.
        assert!(of(MAX_SLIDING_LOG_LIMIT + 1).is_ok());
        assert!(of(MAX_CONCURRENCY_SLOTS).is_ok());
        let text = of(MAX_CONCURRENCY_SLOTS + 1)
            .expect_err("too large")
            .to_string();
        assert!(
            text.contains("exports") && text.contains("100,000"),
            "{text}"
        );
    }

    #[test]
    fn a_sliding_log_takes_a_limit_of_ten_thousand_at_most() {
        use spillway::Quota;
        use spillway::algorithm::SlidingLog;
        let of = |n| {
            let quota = Quota::per_minute(std::num::NonZeroU32::new(n).expect("nonzero"));
            params("logins", &SlidingLog::new(quota).into())
        };
        assert!(of(MAX_SLIDING_LOG_LIMIT).is_ok());
        let refused = of(MAX_SLIDING_LOG_LIMIT + 1).expect_err("too large");
        let text = refused.to_string();
        assert!(text.contains("logins") && text.contains("10,000"), "{text}");
        assert!(text.contains("sliding window"), "{text}");
    }

    #[test]
    fn the_test_clock_is_off_in_the_service_scripts() {
        assert!(source(false).starts_with("local ALLOW_TIME_OVERRIDE = false\n"));
        for family in 0..SINGLE_SCRIPTS {
            assert!(
                single_source(family, false).starts_with("local ALLOW_TIME_OVERRIDE = false\n")
            );
        }
    }

    #[test]
    fn a_single_check_script_reads_exactly_its_parameters() {
        use spillway::Quota;
        use spillway::algorithm::{FixedWindow, LeakyBucket, SlidingLog};
        let quota = Quota::per_second(std::num::NonZeroU32::new(10).expect("nonzero"));
        let fw = params("fw", &FixedWindow::new(quota).into()).expect("fits");
        assert_eq!(single_args(&fw), &[10, 1_000_000]);
        let src = single_source(family(&fw), false);
        assert!(
            src.contains("local limit, w, cost = ARGV[1] + 0, ARGV[2] + 0, ARGV[3] + 0"),
            "{src}"
        );
        // A sliding log and a concurrency rule: a limit and a window (the
        // lease), each in a script of its own.
        let sl = params("sl", &SlidingLog::new(quota).into()).expect("fits");
        assert_eq!(single_args(&sl), &[10, 1_000_000]);
        let cc = params("cc", &spillway::algorithm::Concurrency::new(quota).into()).expect("fits");
        assert_eq!(single_args(&cc), &[10, 1_000_000]);
        assert_ne!(family(&cc), family(&sl));
        let src = single_source(family(&cc), false);
        assert!(
            src.contains("local p1, p2 = ARGV[1] + 0, ARGV[2] + 0"),
            "{src}"
        );
        assert!(src.contains("leases('check', key, state, cost, now, p1, p2)"));
        assert!(!src.contains("ALGORITHM") && !src.contains("ARITY") && !src.contains("PARAMS"));
        let shape = params(
            "lb",
            &LeakyBucket::shape(quota, std::num::NonZeroU32::MIN).into(),
        )
        .expect("fits");
        assert_eq!(single_args(&shape).len(), 5);
        assert!(single_source(family(&shape), false).contains("local cost = ARGV[6] + 0"));
    }
}
