//! What the property test files share: proptest's configuration. Runs are deterministic (a
//! fixed seed) unless `PROPTEST_RNG_SEED` is set; `PROPTEST_CASES` scales every property.

use proptest::test_runner::{Config, RngSeed};

/// `cases` per property, a fixed seed unless the environment picks one, and no regression
/// files written next to the tests (a fixed seed replays a failure anyway).
pub fn config(cases: u32) -> Config {
    let base = Config::default();
    let seeded = std::env::var_os("PROPTEST_RNG_SEED").is_some();
    Config {
        cases: if std::env::var_os("PROPTEST_CASES").is_some() {
            base.cases
        } else {
            cases
        },
        rng_seed: if seeded {
            base.rng_seed
        } else {
            RngSeed::Fixed(0x6c6c_6d67)
        },
        failure_persistence: None,
        ..base
    }
}
