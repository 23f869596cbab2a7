//! The scenario in force: when it started, which requests it targets (`keys`, `until_ms`) and
//! how many rejections it has left (`count`).

use std::time::Instant;

use crate::scenario::Scenario;

pub struct Run {
    scenario: Scenario,
    started: Instant,
    remaining_count: Option<u64>,
}

impl Run {
    /// The scenario from now on, with all of its `count` left.
    pub fn start(scenario: Scenario) -> Run {
        Run {
            remaining_count: scenario.count,
            scenario,
            started: Instant::now(),
        }
    }

    pub fn scenario(&self) -> &Scenario {
        &self.scenario
    }

    /// Time since the scenario started, in ms.
    pub fn elapsed_ms(&self, now: Instant) -> f64 {
        now.saturating_duration_since(self.started).as_secs_f64() * 1000.0
    }

    /// Whether the scenario applies to a request of `key` arriving `t_ms` after it started.
    pub fn targets(&self, key: &str, t_ms: f64) -> bool {
        let sc = &self.scenario;
        sc.keys
            .as_ref()
            .map_or(true, |keys| keys.iter().any(|k| k == key))
            && sc.until_ms.map_or(true, |u| t_ms < u)
            && self.remaining_count != Some(0)
    }

    /// A rejection uses one unit of `count`.
    pub fn count_rejection(&mut self) {
        if let Some(c) = self.remaining_count.as_mut() {
            *c = c.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant, SystemTime};

    use crate::dialect::Dialect;
    use crate::sim::testing::{info, scenario};
    use crate::sim::State;

    #[test]
    fn count_keys_and_until() {
        let mut st = State::new(scenario(
            r#"{"mode":"rate_limited","count":2,"keys":["a"]}"#,
        ));
        let now = Instant::now();
        let sys = SystemTime::now();
        assert_eq!(st.decide(&info("b"), now, sys).status, 200);
        assert_eq!(st.decide(&info("a"), now, sys).status, 429);
        assert_eq!(st.decide(&info("a"), now, sys).status, 429);
        assert_eq!(st.decide(&info("a"), now, sys).status, 200);

        st.set_scenario(scenario(r#"{"mode":"overloaded","until_ms":500}"#));
        let t0 = Instant::now();
        let mut i = info("a");
        i.dialect = Dialect::Anthropic;
        assert_eq!(st.decide(&i, t0, sys).status, 529);
        assert_eq!(st.decide(&info("a"), t0, sys).status, 503);
        assert_eq!(
            st.decide(&i, t0 + Duration::from_millis(600), sys).status,
            200
        );
    }
}
