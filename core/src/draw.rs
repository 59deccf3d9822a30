//! Random shapes for property tests (tests only): a guarantee is checked across shapes drawn
//! at random per run, its seed printed so a failing one can be drawn again.

/// A small xorshift: reproducible without a dependency.
pub struct Rng(u64);

impl Rng {
    /// A fixed seed: the same draws wherever the test runs.
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    /// Seeded from `WEIR_SEED` if set, else the clock; the seed is printed, so a failing
    /// shape can be drawn again.
    pub fn seeded(test: &str) -> Rng {
        let seed = std::env::var("WEIR_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
                now.map_or(1, |d| d.as_nanos() as u64) | 1
            });
        println!("{test}: seed {seed} (WEIR_SEED={seed} draws it again)");
        Rng(seed.max(1))
    }

    pub fn draw(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A draw in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.draw().checked_rem(n).unwrap_or(0)
    }

    /// `Some` of a draw in `1..=max` half the time.
    pub fn maybe(&mut self, max: u64) -> Option<u64> {
        (self.below(2) == 0).then(|| 1 + self.below(max))
    }

    /// A draw in `0..len` (0 when `len` is 0), for an index.
    pub fn index(&mut self, len: usize) -> usize {
        usize::try_from(self.below(len as u64)).unwrap_or(0)
    }

    /// One of `from`, which must not be empty.
    pub fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.index(from.len())]
    }
}
