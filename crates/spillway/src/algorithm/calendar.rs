//! Calendar periods: a day, an ISO week (Monday to Sunday) or a month, in
//! a time zone. A fixed window over a calendar period starts afresh at the
//! period's first instant in that zone, whatever the period's length: a
//! day of 23 or 25 hours across a daylight saving change, a month of 28
//! to 31 days ([`FixedWindow::calendar`](super::FixedWindow::calendar)).
//!
//! ```
//! use spillway::algorithm::{Calendar, Period};
//!
//! let paris = Calendar::new(Period::Month, "Europe/Paris".parse().unwrap());
//! // 2026-03-31 22:30 UTC is already April 1st in Paris (UTC+2).
//! let t = 1_774_996_200_000_000;
//! let april = paris.index(t);
//! assert_eq!(paris.start(april), 1_774_994_400_000_000); // 22:00 UTC
//! assert_eq!(paris.start(april + 1), 1_777_586_400_000_000); // May 1st, 00:00 in Paris
//! ```

use std::time::Duration;

use chrono::{DateTime, Datelike, Days, LocalResult, NaiveDate, TimeZone, Utc};
pub use chrono_tz::Tz;

use crate::clock::Micros;

/// What a calendar window spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Period {
    /// A day, from midnight.
    Day,
    /// An ISO week, from Monday's midnight.
    Week,
    /// A month, from the first day's midnight.
    Month,
}

impl Period {
    /// The period's name, as written in configuration files
    /// (`calendar_day`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Self::Day => "calendar_day",
            Self::Week => "calendar_week",
            Self::Month => "calendar_month",
        }
    }

    /// The period's usual length, for what reports a window's length in
    /// seconds (a day of 24 hours, a week of 7 days, a month of 30 days):
    /// the window itself runs from one period's start to the next's.
    pub const fn nominal(self) -> Duration {
        match self {
            Self::Day => Duration::from_secs(86_400),
            Self::Week => Duration::from_secs(7 * 86_400),
            Self::Month => Duration::from_secs(30 * 86_400),
        }
    }
}

/// A calendar period in a time zone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Calendar {
    period: Period,
    zone: Tz,
}

/// The period a thread's last [`Calendar::index`] found, and where it
/// starts and ends: the zone's rules are looked up again only when a time
/// falls outside it.
#[derive(Clone, Copy)]
struct Found {
    calendar: Calendar,
    k: u64,
    start: Micros,
    end: Micros,
}

thread_local! {
    static LAST: std::cell::Cell<Option<Found>> = const { std::cell::Cell::new(None) };
}

/// The first day counted: a Monday, so that a week's index is its days' / 7.
fn base() -> NaiveDate {
    NaiveDate::from_ymd_opt(1900, 1, 1).expect("a valid date")
}

impl Calendar {
    /// Periods of `period` in `zone` (an IANA name parsed as [`Tz`]:
    /// `"Europe/Paris"`, `"UTC"`).
    pub const fn new(period: Period, zone: Tz) -> Self {
        Self { period, zone }
    }

    /// The period.
    pub const fn period(&self) -> Period {
        self.period
    }

    /// The time zone.
    pub const fn zone(&self) -> Tz {
        self.zone
    }

    /// The index of the period that holds instant `t` (µs since the Unix
    /// epoch): days, weeks or months since January 1900, in the zone.
    /// Later periods have larger indices.
    pub fn index(&self, t: Micros) -> u64 {
        // Most calls fall in the period the last one on this thread found.
        if let Some(k) = LAST.with(|last| {
            last.get()
                .filter(|l| l.calendar == *self && l.start <= t && t < l.end)
                .map(|l| l.k)
        }) {
            return k;
        }
        let found = self.find(t);
        LAST.with(|last| last.set(Some(found)));
        found.k
    }

    /// The period that holds `t`, worked out: the last whose first instant
    /// is at or before `t`. That is the period of `t`'s local date, except
    /// where a zone set its clocks back over midnight (St. John's did at
    /// 00:01 until 2010): its local date is then yesterday's again for a
    /// while, but the day it left has begun, and periods do not go back.
    fn find(&self, t: Micros) -> Found {
        let mut k = self.index_of_date(t);
        let mut end = self.start_of(k.saturating_add(1));
        // Clocks set back over midnight leave at most the next period
        // begun; past the last date known (the year 262143), every start
        // is `Micros::MAX`.
        if end <= t && end != Micros::MAX {
            k += 1;
            end = self.start_of(k.saturating_add(1));
        }
        Found {
            calendar: *self,
            k,
            start: self.start_of(k),
            end,
        }
    }

    /// The index of the period of `t`'s local date.
    fn index_of_date(&self, t: Micros) -> u64 {
        let date = self.local_date(t);
        let days = u64::try_from((date - base()).num_days()).unwrap_or(0);
        match self.period {
            Period::Day => days,
            Period::Week => days / 7,
            Period::Month => {
                let years = u64::try_from(date.year() - 1900).unwrap_or(0);
                years * 12 + u64::from(date.month0())
            }
        }
    }

    /// When period `k` starts: the first instant whose date in the zone is
    /// its first day (local midnight, or the end of a daylight saving gap
    /// that swallowed midnight), in µs since the Unix epoch (0 before it).
    pub fn start(&self, k: u64) -> Micros {
        let cached = LAST.with(|last| {
            let l = last.get().filter(|l| l.calendar == *self)?;
            if k == l.k {
                Some(l.start)
            } else if Some(k) == l.k.checked_add(1) {
                Some(l.end)
            } else {
                None
            }
        });
        cached.unwrap_or_else(|| self.start_of(k))
    }

    /// [`start`](Self::start), worked out.
    fn start_of(&self, k: u64) -> Micros {
        let first = match self.period {
            Period::Day => base().checked_add_days(Days::new(k)),
            Period::Week => base().checked_add_days(Days::new(k.saturating_mul(7))),
            Period::Month => i32::try_from(k / 12)
                .ok()
                .and_then(|years| years.checked_add(1900))
                .and_then(|year| {
                    let month = u32::try_from(k % 12).expect("less than 12") + 1;
                    NaiveDate::from_ymd_opt(year, month, 1)
                }),
        };
        first.map_or(Micros::MAX, |date| self.first_instant(date))
    }

    /// The date of instant `t` in the zone.
    /// (From the end of the year 9999 on, the date of then: chrono's dates
    /// end a little after, where a zone east of UTC would run past them.)
    fn local_date(&self, t: Micros) -> NaiveDate {
        const LAST: i64 = 253_402_300_799_999_999; // 9999-12-31T23:59:59.999999Z
        let t = i64::try_from(t).unwrap_or(LAST).min(LAST);
        DateTime::<Utc>::from_timestamp_micros(t)
            .unwrap_or(DateTime::<Utc>::MAX_UTC)
            .with_timezone(&self.zone)
            .date_naive()
    }

    /// The first instant whose date in the zone is `date`.
    fn first_instant(&self, date: NaiveDate) -> Micros {
        let midnight = date.and_hms_opt(0, 0, 0).expect("midnight");
        let micros = |dt: DateTime<Tz>| u64::try_from(dt.timestamp_micros()).unwrap_or(0);
        match self.zone.from_local_datetime(&midnight) {
            LocalResult::Single(dt) => micros(dt),
            // Midnight twice (the clock went back over it): the first.
            LocalResult::Ambiguous(first, _) => micros(first),
            // Midnight skipped: the day starts when the gap ends, the
            // least instant whose local date is `date`; found by halving
            // two days around midnight read as UTC (offsets are within 26
            // hours of it), on which the local date only moves forward.
            LocalResult::None => {
                let at_utc = midnight.and_utc().timestamp_micros();
                let day = 86_400_000_000_i64;
                let (mut lo, mut hi) = (at_utc.saturating_sub(2 * day), at_utc + 2 * day);
                while hi - lo > 1 {
                    let mid = lo + (hi - lo) / 2;
                    let local = DateTime::<Utc>::from_timestamp_micros(mid)
                        .map(|t| t.with_timezone(&self.zone).date_naive());
                    if local.is_some_and(|d| d >= date) {
                        hi = mid;
                    } else {
                        lo = mid;
                    }
                }
                u64::try_from(hi).unwrap_or(0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> Micros {
        let t = DateTime::parse_from_rfc3339(s).expect("an RFC 3339 time");
        u64::try_from(t.timestamp_micros()).expect("after 1970")
    }

    fn zone(name: &str) -> Tz {
        name.parse().expect("a time zone")
    }

    #[test]
    fn a_day_across_daylight_saving_is_23_or_25_hours() {
        let ny = Calendar::new(Period::Day, zone("America/New_York"));
        // Clocks went forward at 02:00 on 2026-03-08, back on 2026-11-01.
        let k = ny.index(at("2026-03-08T12:00:00-04:00"));
        assert_eq!(ny.start(k), at("2026-03-08T00:00:00-05:00"));
        assert_eq!(ny.start(k + 1) - ny.start(k), 23 * 3_600_000_000);
        let k = ny.index(at("2026-11-01T12:00:00-05:00"));
        assert_eq!(ny.start(k + 1) - ny.start(k), 25 * 3_600_000_000);
        // The last microsecond of a day is in it; the next is not.
        let end = ny.start(k + 1);
        assert_eq!(ny.index(end - 1), k);
        assert_eq!(ny.index(end), k + 1);
    }

    #[test]
    fn months_have_their_own_lengths_and_start_in_the_zone() {
        let utc = Calendar::new(Period::Month, Tz::UTC);
        let feb = utc.index(at("2028-02-15T00:00:00Z"));
        assert_eq!(utc.start(feb), at("2028-02-01T00:00:00Z"));
        assert_eq!(utc.start(feb + 1), at("2028-03-01T00:00:00Z"));
        assert_eq!(utc.start(feb + 1) - utc.start(feb), 29 * 86_400_000_000);
        let dec = utc.index(at("2026-12-31T23:59:59Z"));
        assert_eq!(utc.start(dec + 1), at("2027-01-01T00:00:00Z"));
        // Tokyo's month starts 9 hours before UTC's.
        let tokyo = Calendar::new(Period::Month, zone("Asia/Tokyo"));
        let k = tokyo.index(at("2026-12-31T16:00:00Z"));
        assert_eq!(tokyo.start(k), at("2027-01-01T00:00:00+09:00"));
    }

    #[test]
    fn a_week_runs_from_monday() {
        let berlin = Calendar::new(Period::Week, zone("Europe/Berlin"));
        // Thursday 2026-12-03.
        let k = berlin.index(at("2026-12-03T10:00:00+01:00"));
        assert_eq!(berlin.start(k), at("2026-11-30T00:00:00+01:00"));
        assert_eq!(berlin.start(k + 1), at("2026-12-07T00:00:00+01:00"));
    }

    /// The thread's cache answers what working it out does, with two
    /// calendars taking turns and times both in order and out of it.
    #[test]
    fn the_cache_answers_as_the_zone_rules_do() {
        let calendars = [
            Calendar::new(Period::Day, zone("America/New_York")),
            Calendar::new(Period::Month, zone("Australia/Lord_Howe")),
            Calendar::new(Period::Week, zone("Pacific/Apia")),
        ];
        let from = at("2011-01-01T00:00:00Z");
        let step = 37 * 60 * 1_000_000 + 123;
        for i in 0..40_000u64 {
            let t = if i % 7 == 0 {
                from + (i * 7_919 % 40_000) * step
            } else {
                from + i * step
            };
            for c in &calendars {
                let k = c.index(t);
                assert_eq!(k, c.find(t).k, "{c:?} at {t}");
                assert_eq!(c.start(k), c.start_of(k), "{c:?} {k}");
                assert_eq!(c.start(k + 1), c.start_of(k + 1), "{c:?} {k}");
                assert!(c.start(k) <= t && t < c.start(k + 1), "{c:?} at {t}");
            }
        }
    }

    /// St. John's set its clocks back from 00:01 to 23:01 the day before
    /// (2006-10-29 at 02:31 UTC): for that hour the local date is the 28th
    /// again, but the 29th has begun, and stays the period.
    #[test]
    fn a_day_that_began_stays_begun_when_the_clocks_go_back_over_midnight() {
        let sj = Calendar::new(Period::Day, zone("America/St_Johns"));
        let t = at("2006-10-29T02:32:00Z");
        let k = sj.index(t);
        assert_eq!(sj.start(k), at("2006-10-29T00:00:00-02:30"));
        assert!(sj.start(k) <= t && t < sj.start(k + 1));
        // 23:59 on the 28th, then 00:00:30 on the 29th (daylight time).
        assert_eq!(sj.index(at("2006-10-29T02:29:00Z")), k - 1);
        assert_eq!(sj.index(at("2006-10-29T02:30:30Z")), k);
        assert_eq!(sj.index(sj.start(k) - 1), k - 1);
        // And after the hour repeated, the 29th still.
        assert_eq!(sj.index(at("2006-10-29T03:35:00Z")), k);
    }

    /// Times far past any clock's answer as the last day of the year 9999
    /// does, in a zone east of UTC too, and no period runs back.
    #[test]
    fn the_far_future_does_not_panic() {
        for c in [
            Calendar::new(Period::Day, zone("Pacific/Kiritimati")),
            Calendar::new(Period::Month, zone("Europe/Paris")),
            Calendar::new(Period::Week, Tz::UTC),
        ] {
            let last = c.index(u64::MAX);
            assert!(last >= c.index(253_402_300_799_999_999), "{c:?}");
            assert!(c.start(last) <= c.start(last + 1), "{c:?}");
            assert_eq!(c.start(u64::MAX), Micros::MAX, "{c:?}");
        }
        let fw = super::super::FixedWindow::calendar(
            std::num::NonZeroU32::MIN,
            Calendar::new(Period::Month, zone("Europe/Paris")),
        );
        let mut state = Default::default();
        assert!(
            super::super::Algorithm::check(&fw, &mut state, 1, u64::MAX)
                .unwrap()
                .allowed
        );
    }

    #[test]
    fn a_day_whose_midnight_was_skipped_starts_when_the_gap_ends() {
        // Sao Paulo moved its clocks from 00:00 to 01:00 on 2018-11-04.
        let sp = Calendar::new(Period::Day, zone("America/Sao_Paulo"));
        let k = sp.index(at("2018-11-04T12:00:00-02:00"));
        assert_eq!(sp.start(k), at("2018-11-04T01:00:00-02:00"));
        assert_eq!(sp.index(sp.start(k) - 1), k - 1);
    }
}
