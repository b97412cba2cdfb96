//! The whole conformance suite against the in-memory store.

use spillway::algorithm::Renewed;
use spillway::clock::FakeClock;
use spillway::store::{Check, MemoryOptions, MemoryStore, Renew, Rule, Settle, Settled, Verdict};
use spillway_conformance::{Harness, HarnessError};

/// The in-memory store, told the time of each step through `check_at` and
/// `settle_at`.
struct Memory(MemoryStore<FakeClock>);

impl Memory {
    fn new(rules: Vec<Rule>) -> Self {
        // The clock is never read: every step passes its own time.
        Self(MemoryStore::with_clock(
            rules,
            MemoryOptions::default(),
            FakeClock::new(0),
        ))
    }
}

impl Harness for Memory {
    fn check(&mut self, checks: &[Check<'_>], now_us: u64) -> Result<Verdict, HarnessError> {
        Ok(self.0.check_at(checks, now_us)?)
    }

    fn reserve(
        &mut self,
        id: &str,
        checks: &[Check<'_>],
        now_us: u64,
    ) -> Result<Verdict, HarnessError> {
        Ok(self.0.reserve_at(id, checks, now_us)?)
    }

    fn settle(
        &mut self,
        id: &str,
        settles: &[Settle<'_>],
        now_us: u64,
    ) -> Result<Settled, HarnessError> {
        Ok(self.0.settle_at(id, settles, now_us)?)
    }

    fn renew(&mut self, renews: &[Renew<'_>], now_us: u64) -> Result<Vec<Renewed>, HarnessError> {
        Ok(self.0.renew_at(renews, now_us)?)
    }
}

#[test]
fn memory_store_passes_the_suite() {
    let report = spillway_conformance::run_all(Memory::new);
    println!("{report}");
}
