//! What the simulator's state tests share: a request, a scenario, and the last log entry.

use super::{ReqInfo, State};
use crate::dialect::Dialect;
use crate::scenario::Scenario;

pub fn info(key: &str) -> ReqInfo<'_> {
    ReqInfo {
        method: "POST",
        path: "/v1/chat/completions",
        key,
        dialect: Dialect::OpenAi,
        est_input_tokens: 10,
        max_output_tokens: None,
        forced_status: None,
        model: "m",
        prompt: None,
    }
}

pub fn scenario(j: &str) -> Scenario {
    Scenario::parse(j.as_bytes()).unwrap()
}

/// The last log entry as (decision, status, hint_ms).
pub fn last(st: &State) -> (String, u64, Option<u64>) {
    let doc = st.requests_json();
    let e = doc["requests"].as_array().unwrap().last().unwrap().clone();
    (
        e["decision"].as_str().unwrap().to_string(),
        e["status"].as_u64().unwrap(),
        e["hint_ms"].as_u64(),
    )
}
