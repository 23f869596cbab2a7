//! Every time format providers send, on arbitrary text: `None` or a bounded value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llm_governor_core::time::{self, MAX_PARSED_MS};

fuzz_target!(|data: &[u8]| {
    let owned;
    let s = match std::str::from_utf8(data) {
        Ok(s) => s,
        Err(_) => {
            owned = String::from_utf8_lossy(data).into_owned();
            &owned
        }
    };
    // The same text in every unit: all accept it or none, larger units never give less.
    let units = [1, 1000, 60_000, 1_000_000_000];
    let parsed = units.map(|u| time::parse_decimal_ms(s, u));
    assert!(
        parsed.iter().all(Option::is_some) || parsed.iter().all(Option::is_none),
        "{parsed:?}"
    );
    for w in parsed.windows(2) {
        if let [Some(a), Some(b)] = w {
            assert!(a <= b && *b <= MAX_PARSED_MS, "{parsed:?}");
        }
    }
    if let Some(ms) = time::parse_go_duration_ms(s) {
        assert!(ms <= MAX_PARSED_MS, "{ms}");
    }
    let proto = time::parse_proto_duration_ms(s);
    assert_eq!(
        proto,
        s.trim()
            .strip_suffix('s')
            .and_then(|n| time::parse_decimal_ms(n, 1000))
    );
    // Absolute times, then the delay they mean from any clock.
    let nows = [0, llm_governor_fuzz::T0, i64::MAX as u64, u64::MAX];
    for at in [time::parse_rfc3339_ms(s), time::parse_http_date_ms(s)]
        .into_iter()
        .flatten()
    {
        for now in nows {
            if let Some(ms) = time::until(at, now) {
                assert!(ms > 0 && ms <= MAX_PARSED_MS, "{at} from {now}: {ms}");
            }
        }
    }
});
