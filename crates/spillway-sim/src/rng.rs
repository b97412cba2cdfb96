//! A small seeded random generator, so that a seed gives the same traffic on
//! every machine and every run (no dependency on a crate's stream staying
//! stable across versions).

/// SplitMix64: a 64-bit state advanced by a constant and mixed. Plenty for
/// drawing arrival times; not for anything that must be unpredictable.
#[derive(Debug, Clone)]
pub(crate) struct Rng {
    state: u64,
}

impl Rng {
    /// A generator for `seed`, on the stream `stream` (so that two scenarios
    /// built from one seed do not draw the same numbers).
    pub(crate) fn new(seed: u64, stream: u64) -> Self {
        let mut rng = Self {
            state: seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03),
        };
        // One draw to spread nearby seeds apart.
        rng.next_u64();
        rng
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `(0, 1]`: never 0, so its logarithm is finite.
    pub(crate) fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Exponentially distributed with the given mean: the gap between two
    /// arrivals of a Poisson process.
    pub(crate) fn exponential(&mut self, mean: f64) -> f64 {
        -self.unit().ln() * mean
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_numbers_other_stream_other_numbers() {
        let a: Vec<u64> = (0..4).map(|_| Rng::new(7, 1).next_u64()).collect();
        let mut r = Rng::new(7, 1);
        let b: Vec<u64> = (0..4).map(|_| r.next_u64()).collect();
        assert_eq!(a[0], b[0]);
        assert_ne!(Rng::new(7, 1).next_u64(), Rng::new(7, 2).next_u64());
    }

    #[test]
    fn exponential_has_the_right_mean() {
        let mut r = Rng::new(1, 0);
        let n = 100_000;
        let mean = (0..n).map(|_| r.exponential(10.0)).sum::<f64>() / f64::from(n);
        assert!((mean - 10.0).abs() < 0.2, "{mean}");
    }
}
