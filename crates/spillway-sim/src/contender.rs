//! The algorithms compared, each configured from one quota.

use std::fmt;
use std::num::NonZeroU32;
use std::str::FromStr;

use spillway::Quota;
use spillway::algorithm::{
    AnyAlgorithm, FixedWindow, LeakyBucket, SlidingLog, SlidingWindow, TokenBucket,
};

/// One of the five algorithms, with the leaky bucket's two modes apart.
///
/// All are built from the same quota `L` per `W`: the windows count `L`
/// per window `W`; the buckets refill (or drain) at `L` per `W` and hold
/// `burst` units.
///
/// ```
/// use std::num::NonZeroU32;
/// use spillway::Quota;
/// use spillway::algorithm::Algorithm;
/// use spillway_sim::AlgorithmKind;
///
/// let quota = Quota::per_second(NonZeroU32::new(10).unwrap());
/// let tb = AlgorithmKind::TokenBucket.build(quota, NonZeroU32::new(5).unwrap());
/// assert_eq!(tb.capacity(), 5);
/// assert_eq!("leaky_bucket_shape".parse(), Ok(AlgorithmKind::LeakyShape));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AlgorithmKind {
    /// `fixed_window`.
    FixedWindow,
    /// `sliding_log`: exact, and the reference for the error columns.
    SlidingLog,
    /// `sliding_window`, the sliding window counter.
    SlidingWindow,
    /// `token_bucket`, burst `burst`.
    TokenBucket,
    /// `leaky_bucket` in shape mode, capacity `burst`: admitted requests are
    /// delayed to leave at the rate.
    LeakyShape,
    /// `leaky_bucket` in police mode, capacity `burst`: no delay.
    LeakyPolice,
}

impl AlgorithmKind {
    /// All six, in the order they are reported.
    pub const ALL: [Self; 6] = [
        Self::FixedWindow,
        Self::SlidingLog,
        Self::SlidingWindow,
        Self::TokenBucket,
        Self::LeakyShape,
        Self::LeakyPolice,
    ];

    /// The name in tables, files and on the command line.
    pub const fn name(self) -> &'static str {
        match self {
            Self::FixedWindow => "fixed_window",
            Self::SlidingLog => "sliding_log",
            Self::SlidingWindow => "sliding_window",
            Self::TokenBucket => "token_bucket",
            Self::LeakyShape => "leaky_bucket_shape",
            Self::LeakyPolice => "leaky_bucket_police",
        }
    }

    /// The algorithm for `quota`, with `burst` as the buckets' size.
    pub fn build(self, quota: Quota, burst: NonZeroU32) -> AnyAlgorithm {
        match self {
            Self::FixedWindow => FixedWindow::new(quota).into(),
            Self::SlidingLog => SlidingLog::new(quota).into(),
            Self::SlidingWindow => SlidingWindow::new(quota).into(),
            Self::TokenBucket => TokenBucket::new(quota, burst).into(),
            Self::LeakyShape => LeakyBucket::shape(quota, burst).into(),
            Self::LeakyPolice => LeakyBucket::police(quota, burst).into(),
        }
    }

    /// Parses a comma-separated list of names; `all` is every algorithm and
    /// `leaky_bucket` both of its modes. Duplicates are dropped.
    ///
    /// ```
    /// use spillway_sim::AlgorithmKind;
    /// let kinds = AlgorithmKind::parse_list("sliding_log,leaky_bucket").unwrap();
    /// assert_eq!(kinds, [AlgorithmKind::SlidingLog, AlgorithmKind::LeakyShape, AlgorithmKind::LeakyPolice]);
    /// assert_eq!(AlgorithmKind::parse_list("all").unwrap().len(), 6);
    /// ```
    pub fn parse_list(list: &str) -> Result<Vec<Self>, String> {
        let mut kinds = Vec::new();
        for name in list.split(',').map(str::trim) {
            let some: &[Self] = match name {
                "all" => &Self::ALL,
                "leaky_bucket" => &[Self::LeakyShape, Self::LeakyPolice],
                _ => &[name.parse::<Self>()?],
            };
            for k in some {
                if !kinds.contains(k) {
                    kinds.push(*k);
                }
            }
        }
        Ok(kinds)
    }
}

impl fmt::Display for AlgorithmKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for AlgorithmKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| {
            let names: Vec<_> = Self::ALL.iter().map(|k| k.name()).collect();
            format!(
                "unknown algorithm `{s}`: expected one of {}, leaky_bucket (both modes), or all",
                names.join(", ")
            )
        })
    }
}
