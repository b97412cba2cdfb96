//! How much, per how long: [`Quota`].

use std::fmt;
use std::num::NonZeroU32;
use std::time::Duration;

use crate::clock::Micros;
use crate::error::ConfigError;

/// The longest period or window a quota may have: 2^48 µs, about 8.9 years.
/// The bound keeps every intermediate product inside 128 bits.
pub const MAX_PERIOD: Duration = Duration::from_micros(1 << 48);

/// `limit` units of cost per `period`.
///
/// For the window algorithms the period is the window; for the buckets it
/// sets the rate (`limit / period`). The period is a whole number of
/// microseconds between 1 µs and [`MAX_PERIOD`].
///
/// ```
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use spillway::Quota;
///
/// let free = Quota::per_minute(NonZeroU32::new(100).unwrap());
/// assert_eq!(free.limit().get(), 100);
/// assert_eq!(free.period(), Duration::from_secs(60));
///
/// // A period must be whole microseconds.
/// assert!(Quota::new(NonZeroU32::MIN, Duration::from_nanos(1500)).is_err());
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Quota {
    limit: NonZeroU32,
    period: Micros,
}

impl Quota {
    /// `limit` per `period`. Fails when the period is zero, longer than
    /// [`MAX_PERIOD`], or not a whole number of microseconds.
    pub fn new(limit: NonZeroU32, period: Duration) -> Result<Self, ConfigError> {
        if !period.subsec_nanos().is_multiple_of(1_000) {
            return Err(ConfigError::new(
                "period",
                "must be a whole number of microseconds",
            ));
        }
        if period.is_zero() {
            return Err(ConfigError::new("period", "must be longer than zero"));
        }
        if period > MAX_PERIOD {
            return Err(ConfigError::new(
                "period",
                "must be at most 2^48 microseconds (about 8.9 years)",
            ));
        }
        Ok(Self {
            limit,
            period: period.as_micros() as Micros,
        })
    }

    /// A quota whose parts were taken from a valid one.
    pub(crate) const fn from_parts(limit: NonZeroU32, period: Micros) -> Self {
        Self { limit, period }
    }

    /// `limit` per second.
    pub const fn per_second(limit: NonZeroU32) -> Self {
        Self {
            limit,
            period: 1_000_000,
        }
    }

    /// `limit` per minute.
    pub const fn per_minute(limit: NonZeroU32) -> Self {
        Self {
            limit,
            period: 60_000_000,
        }
    }

    /// `limit` per hour.
    pub const fn per_hour(limit: NonZeroU32) -> Self {
        Self {
            limit,
            period: 3_600_000_000,
        }
    }

    /// How many units of cost per period.
    pub const fn limit(&self) -> NonZeroU32 {
        self.limit
    }

    /// The period (or window).
    pub const fn period(&self) -> Duration {
        Duration::from_micros(self.period)
    }

    /// The period in microseconds.
    pub const fn period_micros(&self) -> Micros {
        self.period
    }

    /// The time one unit of cost is worth, as an exact fraction of
    /// microseconds: `period / limit`, reduced.
    pub fn emission_interval(&self) -> Interval {
        let limit = u64::from(self.limit.get());
        let g = gcd(limit, self.period);
        Interval {
            micros: self.period / g,
            per: limit / g,
        }
    }
}

impl fmt::Debug for Quota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{:?}", self.limit, self.period())
    }
}

/// An exact fraction of a microsecond: `micros / per` µs.
///
/// A bucket keeps its timestamps in units of `1 / per` µs, so that adding
/// one unit of cost (`micros` of those units) never rounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Interval {
    /// The numerator: the interval is `micros / per` microseconds.
    pub micros: u64,
    /// The denominator, at least 1.
    pub per: u64,
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nz(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).unwrap()
    }

    #[test]
    fn emission_interval_is_reduced() {
        let i = Quota::per_minute(nz(100)).emission_interval();
        assert_eq!((i.micros, i.per), (600_000, 1));
        let i = Quota::per_second(nz(3)).emission_interval();
        assert_eq!((i.micros, i.per), (1_000_000, 3));
    }

    #[test]
    fn bad_periods_name_the_field() {
        for period in [Duration::ZERO, Duration::from_nanos(1), MAX_PERIOD * 2] {
            let err = Quota::new(nz(1), period).unwrap_err();
            assert_eq!(err.field(), "period");
        }
        assert!(Quota::new(nz(1), MAX_PERIOD).is_ok());
    }
}
