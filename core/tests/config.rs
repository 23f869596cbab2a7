//! Configuration: the contract's example and `{}` load; every invalid input is rejected with
//! a message naming the field.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use llm_governor_core::classify::Dialect;
use llm_governor_core::config::{self, LimitKey, LimitKind};

const CONTRACT_EXAMPLE: &str = r#"{
  "pools": [
    {"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"},
    {"name": "anthropic", "match": {"path_prefix": "/v1/messages"}, "dialect": "anthropic"}
  ],
  "account_headers": ["x-api-key", "authorization", "api-key", "x-goog-api-key"],
  "retry_after": {"default_ms": 1000, "max_ms": 60000, "jitter": 0.2},
  "cooldown": {"enabled": true, "max_ms": 300000, "quota_ms": 300000},
  "preemptive": true,
  "limits": [
    {"name": "tenant-rpm", "key": "header:x-tenant-id", "requests_per_minute": 600, "burst": 50},
    {"name": "tenant-tpm", "key": "header:x-tenant-id", "tokens_per_minute": 200000}
  ],
  "max_keys": 10000,
  "hold": {"max_ms": 10000, "max_held": 1000, "margin_ms": 2000,
           "deadline_headers": ["x-stainless-read-timeout", "x-stainless-timeout", "x-envoy-expected-rq-timeout-ms"]}
}"#;

#[test]
fn contract_example_loads() {
    let cfg = config::parse(CONTRACT_EXAMPLE.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    let names: Vec<&str> = cfg.pools.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["openai", "anthropic", "default"]);
    assert_eq!(cfg.pools[1].dialect, Dialect::Anthropic);
    assert_eq!(cfg.pools[2].dialect, Dialect::Auto);
    assert_eq!(cfg.limits[0].key, LimitKey::Header("x-tenant-id".into()));
    assert_eq!(
        (
            cfg.limits[0].kind,
            cfg.limits[0].per_window,
            cfg.limits[0].burst
        ),
        (LimitKind::Requests, 600, 50)
    );
    assert_eq!(
        (cfg.limits[1].kind, cfg.limits[1].burst),
        (LimitKind::Tokens, 200_000)
    );
}

#[test]
fn empty_config_gives_defaults() {
    for input in ["{}", "", "  \n"] {
        let cfg = config::parse(input.as_bytes()).unwrap_or_else(|e| panic!("{input:?}: {e}"));
        assert_eq!(cfg, config::Config::default());
        assert_eq!(cfg.retry_after.max_ms, 60_000);
        assert_eq!(cfg.pools.len(), 1);
        // Holding is on by default, with the contract's numbers.
        assert!(cfg.hold.enabled());
        assert_eq!(
            (cfg.hold.max_ms, cfg.hold.max_held, cfg.hold.margin_ms),
            (10_000, 1000, 2000)
        );
        assert_eq!(
            cfg.hold.deadline_headers,
            [
                "x-stainless-read-timeout",
                "x-stainless-timeout",
                "x-envoy-expected-rq-timeout-ms"
            ]
        );
    }
}

#[test]
fn the_contract_example_matches_the_defaults_of_hold() {
    let cfg = config::parse(CONTRACT_EXAMPLE.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(cfg.hold, config::Config::default().hold);
}

#[test]
fn max_in_flight_limits_and_hold_off() {
    let cfg = config::parse(
        br#"{"hold": {"max_ms": 0}, "limits": [{"name": "cap", "key": "account", "max_in_flight": 8}]}"#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(!cfg.hold.enabled());
    assert_eq!(
        (
            cfg.limits[0].kind,
            cfg.limits[0].per_window,
            cfg.limits[0].slot_lease_ms
        ),
        (LimitKind::InFlight, 8, 600_000)
    );
}

/// One row per rate field: the kind of limit, what it counts, its window, and a burst of the
/// window's amount unless one is given; the counting fields' defaults.
#[test]
fn every_rate_field_is_a_limit_of_its_window() {
    use config::{Counts, OutputRule};
    let rows: [(&str, LimitKind, Counts, u64); 6] = [
        (
            "requests_per_minute",
            LimitKind::Requests,
            Counts::Tokens,
            60,
        ),
        (
            "requests_per_day",
            LimitKind::Requests,
            Counts::Tokens,
            86_400,
        ),
        ("tokens_per_minute", LimitKind::Tokens, Counts::Tokens, 60),
        ("tokens_per_day", LimitKind::Tokens, Counts::Tokens, 86_400),
        (
            "input_tokens_per_minute",
            LimitKind::Tokens,
            Counts::InputTokens,
            60,
        ),
        (
            "output_tokens_per_minute",
            LimitKind::Tokens,
            Counts::OutputTokens,
            60,
        ),
    ];
    for (field, kind, counts, window_s) in rows {
        let json = format!(r#"{{"limits": [{{"name": "l", "key": "account", "{field}": 7000}}]}}"#);
        let cfg = config::parse(json.as_bytes()).unwrap_or_else(|e| panic!("{field}: {e}"));
        let l = &cfg.limits[0];
        assert_eq!(
            (l.kind, l.per_window, l.window_s, l.burst),
            (kind, 7000, window_s, 7000),
            "{field}"
        );
        if kind == LimitKind::Tokens {
            assert_eq!(l.counts, counts, "{field}");
            assert_eq!(
                (l.count_cache_reads, l.output, l.min_output_tokens),
                (false, OutputRule::Generated, 64),
                "{field}"
            );
        }
        let json = format!(
            r#"{{"limits": [{{"name": "l", "key": "account", "{field}": 7000, "burst": 9}}]}}"#
        );
        assert_eq!(config::parse(json.as_bytes()).unwrap().limits[0].burst, 9);
    }
    let cfg = config::parse(
        br#"{"limits": [{"name": "i", "key": "account", "input_tokens_per_minute": 20000, "count_cache_reads": true},
                        {"name": "o", "key": "account", "output_tokens_per_minute": 6000, "output": "max_tokens", "min_output_tokens": 0}]}"#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(cfg.limits[0].count_cache_reads);
    assert_eq!(
        (cfg.limits[1].output, cfg.limits[1].min_output_tokens),
        (OutputRule::MaxTokens, 0)
    );
}

/// Every configuration error, one row per case: whole messages, as Envoy's log shows them after
/// `llm_governor: invalid configuration: ` (operators and the end-to-end tests read them).
#[test]
fn invalid_configs_name_the_field() {
    let cases: &[(&str, &str)] = &[
        // The file as a whole, and the order errors are found in.
        (r#"{"pools": [{"name": "a"}"#, "not valid JSON: EOF while parsing a list at line 1 column 24"),
        (r#"[]"#, "must be an object, got an array"),
        (r#"null"#, "must be an object, got null"),
        (r#"{"bogus": 1}"#, "bogus: unknown field (expected one of: pools, account_headers, retry_after, cooldown, preemptive, limits, max_keys, hold, fleet)"),
        // An unknown field is named before any value of its object is looked at, and
        // fields are checked in the DTO's order, not the file's or the alphabet's.
        (r#"{"hold": {"max_ms": -1, "zz": 1}}"#, "hold.zz: unknown field (expected one of: max_ms, max_held, margin_ms, deadline_headers, fair_key, classes)"),
        (r#"{"account_headers": 1, "pools": 1}"#, "pools: must be an array, got a number"),
        // pools
        (r#"{"pools": {}}"#, "pools: must be an array, got an object"),
        (r#"{"pools": "a"}"#, "pools: must be an array, got a string"),
        (r#"{"pools": [{"match": {}}]}"#, "pools[0].name: is required"),
        (r#"{"pools": [{"name": null}]}"#, "pools[0].name: is required"),
        (r#"{"pools": [{"name": "a"}, {"name": 7}]}"#, "pools[1].name: must be a string, got a number"),
        (r#"{"pools": [{"name": "Open AI"}]}"#, "pools[0].name: must match [a-z0-9_-]{1,32}, got \"Open AI\""),
        (r#"{"pools": [{"name": "a"}, {"name": "a"}]}"#, "pools[1].name: duplicate pool name \"a\""),
        (r#"{"pools": [{"name": "default"}]}"#, "pools[0].name: \"default\" is reserved for requests that match no pool"),
        (r#"{"pools": [{"name": "a", "dialect": "cohere"}]}"#, "pools[0].dialect: unknown dialect \"cohere\" (expected openai, anthropic, azure_openai, gemini or auto)"),
        (r#"{"pools": [{"name": "a", "match": {"path_prefix": "v1"}}]}"#, "pools[0].match.path_prefix: must start with '/'"),
        (r#"{"pools": [{"name": "a", "match": {"authority": ""}}]}"#, "pools[0].match.authority: must not be empty"),
        (r#"{"pools": [{"name": "a", "match": {"header": {"name": "x"}}}]}"#, "pools[0].match.header.value: is required"),
        (r#"{"pools": [{"name": "a", "match": {"pathprefix": "/"}}]}"#, "pools[0].match.pathprefix: unknown field (expected one of: path_prefix, authority, header)"),
        (r#"{"pools": [{"name": "a", "match": {"header": {"name": "x", "v": 1}}}]}"#, "pools[0].match.header.v: unknown field (expected one of: name, value)"),
        (r#"{"pools": [{"name": "a", "fallback": ["b"]}, {"name": "b", "fallback": ["a"]}]}"#, "pools[0].fallback: cycle: \"a\" falls back to itself through other pools"),
        // account_headers
        (r#"{"account_headers": ["bad header"]}"#, "account_headers[0]: not a valid header name: \"bad header\""),
        (r#"{"account_headers": [null]}"#, "account_headers[0]: must be a string, got null"),
        // retry_after
        (r#"{"retry_after": {"bogus": 1}}"#, "retry_after.bogus: unknown field (expected one of: default_ms, max_ms, jitter, escalate)"),
        // serde_json's own deserializer would read this array as the struct's fields.
        (r#"{"retry_after": [1000, 60000, 0.2, false]}"#, "retry_after: must be an object, got an array"),
        (r#"{"retry_after": {"jitter": 5}}"#, "retry_after.jitter: must be between 0 and 1"),
        (r#"{"retry_after": {"jitter": -0.5}}"#, "retry_after.jitter: must be between 0 and 1"),
        (r#"{"retry_after": {"jitter": "0.2"}}"#, "retry_after.jitter: must be a number"),
        (r#"{"retry_after": {"max_ms": 0}}"#, "retry_after.max_ms: must be between 1 and 604800000"),
        (r#"{"retry_after": {"default_ms": 1.5}}"#, "retry_after.default_ms: must be an integer between 1 and 604800000"),
        (r#"{"retry_after": {"default_ms": 5000, "max_ms": 1000}}"#, "retry_after.default_ms: must be <= retry_after.max_ms (1000)"),
        // cooldown, preemptive, max_keys
        (r#"{"cooldown": {"enabled": "yes"}}"#, "cooldown.enabled: must be true or false, got a string"),
        (r#"{"cooldown": {"quota_ms": -1}}"#, "cooldown.quota_ms: must be an integer between 1 and 604800000"),
        (r#"{"preemptive": 1}"#, "preemptive: must be true or false, got a number"),
        (r#"{"max_keys": 0}"#, "max_keys: must be between 1 and 10000000"),
        // limits: what each counts, its name and its key
        (r#"{"limits": [{"name": "x", "key": "header:x-t"}]}"#, "limits[0]: one of requests_per_minute, requests_per_day, tokens_per_minute, tokens_per_day, input_tokens_per_minute, output_tokens_per_minute or max_in_flight is required"),
        (r#"{"limits": [{"name": "x", "key": "pool", "requests_per_minute": 1, "tokens_per_minute": 1}]}"#, "limits[0]: set one of requests_per_minute, requests_per_day, tokens_per_minute, tokens_per_day, input_tokens_per_minute, output_tokens_per_minute or max_in_flight, not several"),
        (r#"{"limits": [{"name": "x", "key": "pool", "max_in_flight": 2, "requests_per_minute": 5}]}"#, "limits[0]: set one of requests_per_minute, requests_per_day, tokens_per_minute, tokens_per_day, input_tokens_per_minute, output_tokens_per_minute or max_in_flight, not several"),
        (r#"{"limits": [{"name": "x", "key": "header:x-t", "requests_per_minute": 0}]}"#, "limits[0].requests_per_minute: must be > 0"),
        (r#"{"limits": [{"name": "x", "key": "pool", "requests_per_day": 0}]}"#, "limits[0].requests_per_day: must be > 0"),
        (r#"{"limits": [{"name": "x", "key": "pool", "tokens_per_day": 1000000001}]}"#, "limits[0].tokens_per_day: must be <= 1000000000"),
        (r#"{"limits": [{"name": "x", "key": "pool", "input_tokens_per_minute": -1}]}"#, "limits[0].input_tokens_per_minute: must be > 0"),
        (r#"{"limits": [{"name": "x", "key": "pool", "output_tokens_per_minute": 2.5}]}"#, "limits[0].output_tokens_per_minute: must be a positive integer"),
        (r#"{"limits": [{"name": "x", "key": "pool", "input_tokens_per_minute": 1, "output_tokens_per_minute": 1}]}"#, "limits[0]: set one of requests_per_minute, requests_per_day, tokens_per_minute, tokens_per_day, input_tokens_per_minute, output_tokens_per_minute or max_in_flight, not several"),
        (r#"{"limits": [{"name": "x", "key": "pool", "requests_per_minute": 1, "requests_per_day": 1}]}"#, "limits[0]: set one of requests_per_minute, requests_per_day, tokens_per_minute, tokens_per_day, input_tokens_per_minute, output_tokens_per_minute or max_in_flight, not several"),
        (r#"{"limits": [{"name": "x", "key": "header:x-t", "requests_per_minute": -3}]}"#, "limits[0].requests_per_minute: must be > 0"),
        (r#"{"limits": [{"name": "x", "key": "pool", "requests_per_minute": 1.5}]}"#, "limits[0].requests_per_minute: must be a positive integer"),
        (r#"{"limits": [{"name": "x", "key": "pool", "max_in_flight": 0}]}"#, "limits[0].max_in_flight: must be > 0"),
        (r#"{"limits": [{"name": "x", "key": "pool", "max_in_flight": 2000000}]}"#, "limits[0].max_in_flight: must be <= 1000000"),
        (r#"{"limits": [{"name": "x", "key": "pool", "max_in_flight": 5000000000}]}"#, "limits[0].max_in_flight: must be <= 1000000"),
        (r#"{"limits": [{"name": "x", "key": "pool", "max_in_flight": -3}]}"#, "limits[0].max_in_flight: must be > 0"),
        (r#"{"limits": [{"name": "x", "key": "tenant", "requests_per_minute": 1}]}"#, "limits[0].key: must be \"header:<name>\", \"header:<name>+model\", \"account\", \"pool\" or \"model\", got \"tenant\""),
        (r#"{"limits": [{"name": "x", "key": "header:", "requests_per_minute": 1}]}"#, "limits[0].key: must be \"header:<name>\", \"header:<name>+model\", \"account\", \"pool\" or \"model\", got \"header:\""),
        (r#"{"limits": [{"name": "t", "key": "header:+model", "tokens_per_minute": 5}]}"#, "limits[0].key: must be \"header:<name>\", \"header:<name>+model\", \"account\", \"pool\" or \"model\", got \"header:+model\""),
        (r#"{"limits": [{"name": "x", "key": "pool", "requests_per_minute": 1}, {"name": "x", "key": "pool", "requests_per_minute": 1}]}"#, "limits[1].name: duplicate limit name \"x\""),
        // limits: the fields only some limits take
        (r#"{"limits": [{"name": "x", "key": "pool", "requests_per_minute": 1, "burst": 0}]}"#, "limits[0].burst: must be > 0"),
        (r#"{"limits": [{"name": "x", "key": "pool", "max_in_flight": 2, "burst": 5}]}"#, "limits[0].burst: applies to the rates (requests_per_*, *tokens_per_*), not max_in_flight"),
        (r#"{"limits": [{"name": "x", "key": "pool", "max_in_flight": 2, "burst": "x"}]}"#, "limits[0].burst: applies to the rates (requests_per_*, *tokens_per_*), not max_in_flight"),
        (r#"{"limits": [{"name": "x", "key": "pool", "requests_per_minute": 2, "slot_lease_ms": 5000}]}"#, "limits[0].slot_lease_ms: applies to max_in_flight limits only"),
        (r#"{"limits": [{"name": "x", "key": "pool", "max_in_flight": 2, "slot_lease_ms": 10}]}"#, "limits[0].slot_lease_ms: must be between 1000 and 604800000"),
        (r#"{"limits": [{"name": "r", "key": "pool", "requests_per_minute": 5, "reserve": true}]}"#, "limits[0].reserve: applies to token limits only (tokens_per_minute, tokens_per_day, input_tokens_per_minute, output_tokens_per_minute)"),
        (r#"{"limits": [{"name": "t", "key": "pool", "tokens_per_minute": 5, "reserve": "yes"}]}"#, "limits[0].reserve: must be true or false, got a string"),
        (r#"{"limits": [{"name": "t", "key": "pool", "tokens_per_minute": 5, "reserve": false, "default_output_tokens": 10}]}"#, "limits[0].default_output_tokens: applies only when reserve is true"),
        (r#"{"limits": [{"name": "t", "key": "pool", "tokens_per_minute": 5, "default_output_tokens": -1}]}"#, "limits[0].default_output_tokens: must be an integer between 0 and 1048576"),
        (r#"{"limits": [{"name": "t", "key": "pool", "max_in_flight": 5, "default_output_tokens": 1}]}"#, "limits[0].default_output_tokens: applies to token limits only (tokens_per_minute, tokens_per_day, input_tokens_per_minute, output_tokens_per_minute)"),
        (r#"{"limits": [{"name": "t", "key": "pool", "tokens_per_minute": 5, "settle": "later"}]}"#, "limits[0].settle: must be \"auto\", \"usage\" or \"reservation\", got \"later\""),
        (r#"{"limits": [{"name": "t", "key": "pool", "tokens_per_minute": 5, "reserve": false, "settle": "usage"}]}"#, "limits[0].settle: applies only when reserve is true"),
        (r#"{"limits": [{"name": "t", "key": "pool", "requests_per_minute": 5, "settle": "usage"}]}"#, "limits[0].settle: applies to token limits only (tokens_per_minute, tokens_per_day, input_tokens_per_minute, output_tokens_per_minute)"),
        (r#"{"limits": [{"name": "t", "key": "pool", "output_tokens_per_minute": 5, "count_cache_reads": true}]}"#, "limits[0].count_cache_reads: applies to limits that count input tokens, not output_tokens_per_minute"),
        (r#"{"limits": [{"name": "t", "key": "pool", "requests_per_day": 5, "count_cache_reads": true}]}"#, "limits[0].count_cache_reads: applies to token limits only (tokens_per_minute, tokens_per_day, input_tokens_per_minute, output_tokens_per_minute)"),
        (r#"{"limits": [{"name": "t", "key": "pool", "input_tokens_per_minute": 5, "count_cache_reads": 1}]}"#, "limits[0].count_cache_reads: must be true or false, got a number"),
        (r#"{"limits": [{"name": "t", "key": "pool", "input_tokens_per_minute": 5, "output": "max_tokens"}]}"#, "limits[0].output: applies to limits that count output tokens, not input_tokens_per_minute"),
        (r#"{"limits": [{"name": "t", "key": "pool", "output_tokens_per_minute": 5, "output": "maximum"}]}"#, "limits[0].output: must be \"generated\" or \"max_tokens\", got \"maximum\""),
        (r#"{"limits": [{"name": "t", "key": "pool", "tokens_per_day": 5, "reserve": false, "output": "max_tokens"}]}"#, "limits[0].output: applies only when reserve is true"),
        (r#"{"limits": [{"name": "t", "key": "pool", "output_tokens_per_minute": 5, "min_output_tokens": -1}]}"#, "limits[0].min_output_tokens: must be an integer between 0 and 1048576"),
        (r#"{"limits": [{"name": "t", "key": "pool", "input_tokens_per_minute": 5, "min_output_tokens": 10}]}"#, "limits[0].min_output_tokens: applies to limits that count output tokens, not input_tokens_per_minute"),
        (r#"{"limits": [{"name": "a", "key": "pool", "requests_per_minute": 1, "scope": "fleet"}]}"#, "limits[0].scope: \"fleet\" needs a \"fleet\" section (the rate-limit service's cluster)"),
        (r#"{"fleet": {"cluster": "rls", "reservations": false}, "limits": [{"name": "r", "key": "pool", "requests_per_minute": 1, "scope": "fleet"}, {"name": "a", "key": "pool", "max_in_flight": 1, "scope": "fleet"}]}"#, "limits[1].scope: a fleet max_in_flight holds its slots on the service (Reserve / Commit): set fleet.reservations true"),
        (r#"{"fleet": {"cluster": "rls"}, "limits": [{"name": "a", "key": "pool", "requests_per_minute": 1, "scope": "global"}]}"#, "limits[0].scope: must be \"local\" or \"fleet\", got \"global\""),
        // hold
        (r#"{"hold": {"max_ms": -1}}"#, "hold.max_ms: must be an integer between 0 and 300000"),
        (r#"{"hold": {"max_ms": 300001}}"#, "hold.max_ms: must be between 0 and 300000"),
        (r#"{"hold": {"max_held": 1.5}}"#, "hold.max_held: must be an integer between 0 and 100000"),
        (r#"{"hold": {"margin_ms": "2s"}}"#, "hold.margin_ms: must be an integer between 0 and 300000"),
        (r#"{"hold": {"deadline_headers": ["bad header"]}}"#, "hold.deadline_headers[0]: not a valid header name: \"bad header\""),
        (r#"{"hold": {"deadline_headers": "x-timeout"}}"#, "hold.deadline_headers: must be an array, got a string"),
        (r#"{"hold": {"deadline_headers": ["a", "b", "c", "d", "e", "f", "g", "h", "i",
                   "j", "k", "l", "m", "n", "o", "p", "q"]}}"#, "hold.deadline_headers: at most 16 entries"),
        (r#"{"hold": {"max": 5}}"#, "hold.max: unknown field (expected one of: max_ms, max_held, margin_ms, deadline_headers, fair_key, classes)"),
        // hold: who goes first
        (r#"{"hold": {"fair_key": "tenant"}}"#, "hold.fair_key: must be \"header:<name>\", \"header:<name>+model\", \"account\", \"pool\" or \"model\", got \"tenant\""),
        (r#"{"hold": {"classes": {}}}"#, "hold.classes: must be an array, got an object"),
        (r#"{"hold": {"classes": [{}]}}"#, "hold.classes[0].name: is required"),
        (r#"{"hold": {"classes": [{"name": "Chat"}]}}"#, "hold.classes[0].name: must match [a-z0-9_-]{1,32}, got \"Chat\""),
        (r#"{"hold": {"classes": [{"name": "default"}]}}"#, "hold.classes[0].name: \"default\" is reserved for held requests that match no class"),
        (r#"{"hold": {"classes": [{"name": "chat", "weight": 0}]}}"#, "hold.classes[0].weight: must be between 1 and 1000"),
        (r#"{"hold": {"classes": [{"name": "chat", "weight": 1000000}]}}"#, "hold.classes[0].weight: must be between 1 and 1000"),
        (r#"{"hold": {"classes": [{"name": "chat", "weight": 2.5}]}}"#, "hold.classes[0].weight: must be an integer between 1 and 1000"),
        (r#"{"hold": {"classes": [{"name": "chat", "max_ms": 300001}]}}"#, "hold.classes[0].max_ms: must be between 0 and 300000"),
        (r#"{"hold": {"classes": [{"name": "chat", "max_held": -1}]}}"#, "hold.classes[0].max_held: must be an integer between 0 and 100000"),
        (r#"{"hold": {"classes": [{"name": "chat", "priority": 1}]}}"#, "hold.classes[0].priority: unknown field (expected one of: name, match, weight, max_ms, max_held)"),
        (r#"{"hold": {"classes": [{"name": "chat", "match": {"header": {"name": "x-tier"}}}]}}"#, "hold.classes[0].match.header.value: is required"),
        (r#"{"hold": {"classes": [{"name": "a"}, {"name": "a", "match": {"path_prefix": "/v1"}}]}}"#, "hold.classes[1].name: duplicate class name \"a\""),
        (r#"{"hold": {"classes": [{"name": "all"}, {"name": "chat", "match": {"path_prefix": "/v1"}}]}}"#, "hold.classes[1].match: matches no request: hold.classes[0] (\"all\") comes first and matches every request this one matches"),
        (r#"{"hold": {"classes": [{"name": "v1", "match": {"path_prefix": "/v1"}}, {"name": "chat", "match": {"path_prefix": "/v1/chat"}}]}}"#, "hold.classes[1].match: matches no request: hold.classes[0] (\"v1\") comes first and matches every request this one matches"),
        (r#"{"hold": {"classes": [{"name": "a", "match": {"header": {"name": "x-tier", "value": "1"}}}, {"name": "b", "match": {"header": {"name": "x-tier", "value": "1"}, "path_prefix": "/v1"}}]}}"#, "hold.classes[1].match: matches no request: hold.classes[0] (\"a\") comes first and matches every request this one matches"),
        (r#"{"hold": {"classes": [{"name": "a", "match": {"header": {"name": "x-llm-governor-pool", "value": "x"}}}]}}"#, "hold.classes[0].match.header.name: x-llm-governor-pool is the filter's own (a client's is removed): it matches no request"),
        // fleet
        (r#"{"fleet": {}}"#, "fleet.cluster: is required"),
        (r#"{"fleet": {"cluster": ""}}"#, "fleet.cluster: must be an Envoy cluster name (1 to 255 printable bytes), got \"\""),
        (r#"{"fleet": {"cluster": "rls", "domain": " "}}"#, "fleet.domain: must not be empty"),
        (r#"{"fleet": {"cluster": "rls", "timeout_ms": 0}}"#, "fleet.timeout_ms: must be between 1 and 10000"),
        (r#"{"fleet": {"cluster": "rls", "on_error": "open"}}"#, "fleet.on_error: must be \"local\", \"allow\" or \"deny\", got \"open\""),
    ];
    for (input, want) in cases {
        match config::parse(input.as_bytes()) {
            Ok(_) => panic!("accepted: {input}"),
            Err(e) => assert_eq!(e.to_string(), *want, "{input}"),
        }
    }
}

#[test]
fn null_is_absent_and_a_repeated_key_keeps_its_last_value() {
    let cfg = config::parse(br#"{"retry_after": {"max_ms": null}, "max_keys": 5, "max_keys": 7}"#)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(cfg.retry_after.max_ms, 60_000);
    assert_eq!(cfg.max_keys, 7);
}

#[test]
fn token_limits_reserve_by_default_and_keys_may_name_the_model() {
    let cfg = config::parse(
        br#"{"limits": [
            {"name": "a", "key": "model", "tokens_per_minute": 5},
            {"name": "b", "key": "header:X-Tenant+model", "tokens_per_minute": 5, "default_output_tokens": 0},
            {"name": "c", "key": "pool", "tokens_per_minute": 5, "reserve": false}
        ]}"#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(cfg.limits[0].key, LimitKey::Model { header: None });
    assert!(cfg.limits[0].reserve);
    assert_eq!(
        cfg.limits[0].default_output_tokens,
        config::DEFAULT_OUTPUT_TOKENS
    );
    assert_eq!(
        cfg.limits[1].key,
        LimitKey::Model {
            header: Some("x-tenant".into())
        }
    );
    assert_eq!(cfg.limits[1].default_output_tokens, 0);
    assert!(!cfg.limits[2].reserve);
}

#[test]
fn header_names_are_lowercased() {
    let cfg = config::parse(br#"{"account_headers": ["X-Api-Key"], "limits": [{"name": "t", "key": "header:X-Tenant", "requests_per_minute": 5}]}"#)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(cfg.account_headers, ["x-api-key"]);
    assert_eq!(cfg.limits[0].key, LimitKey::Header("x-tenant".into()));
}

#[test]
fn at_most_64_pools_and_64_limits() {
    let pools = |n: usize| {
        let items: Vec<String> = (0..n)
            .map(|i| format!(r#"{{"name": "p{i}", "match": {{"path_prefix": "/p{i}/"}}}}"#))
            .collect();
        format!(r#"{{"pools": [{}]}}"#, items.join(","))
    };
    let limits = |n: usize| {
        let items: Vec<String> = (0..n)
            .map(|i| format!(r#"{{"name": "l{i}", "key": "pool", "requests_per_minute": 60}}"#))
            .collect();
        format!(r#"{{"limits": [{}]}}"#, items.join(","))
    };
    let cfg = config::parse(pools(64).as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    // The 64 configured ones, then the implicit `default`.
    assert_eq!(cfg.pools.len(), 65);
    assert_eq!(cfg.pools[64].name, "default");
    let cfg = config::parse(limits(64).as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(cfg.limits.len(), 64);
    for (input, field) in [(pools(65), "pools"), (limits(65), "limits")] {
        match config::parse(input.as_bytes()) {
            Ok(_) => panic!("65 {field} accepted"),
            Err(e) => assert_eq!(e.to_string(), format!("{field}: at most 64 entries")),
        }
    }
}

#[test]
fn match_authority_is_stored_lowercase() {
    let cfg = config::parse(
        br#"{"pools": [{"name": "a", "match": {"authority": "API.OpenAI.com", "path_prefix": "/v1/"}}]}"#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        cfg.pools[0].matcher.authority.as_deref(),
        Some("api.openai.com")
    );
    assert_eq!(cfg.pools[0].matcher.path_prefix.as_deref(), Some("/v1/"));
}

#[test]
fn hold_classes_keep_their_order_and_the_implicit_default_class_comes_last() {
    let cfg = config::parse(
        br#"{"hold": {"max_ms": 0, "fair_key": "header:X-Tenant-Id", "classes": [
          {"name": "interactive", "match": {"header": {"name": "x-tenant-id", "value": "chat"}}, "weight": 4, "max_ms": 8000},
          {"name": "batch", "match": {"path_prefix": "/v1/batch"}, "max_ms": 120000, "max_held": 50}]}}"#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let hold = &cfg.hold;
    assert_eq!(hold.fair_key, Some(LimitKey::Header("x-tenant-id".into())));
    let rows: Vec<(&str, u64, u64, u64)> = (0..hold.classes.len())
        .map(|c| {
            let class = &hold.classes[c];
            (
                class.name.as_str(),
                class.weight,
                hold.max_ms_of(c),
                hold.max_held_of(c),
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            ("interactive", 4, 8_000, 1000),
            ("batch", 1, 120_000, 50),
            // hold.max_ms 0: requests of no class are not held; the classes still are.
            ("default", 1, 0, 1000),
        ]
    );
    assert!(
        hold.enabled(),
        "a class holds, so the pace rations releases"
    );
    let none =
        config::parse(br#"{"hold": {"classes": [{"name": "all", "max_ms": 0}], "max_ms": 0}}"#)
            .unwrap_or_else(|e| panic!("{e}"));
    assert!(!none.hold.enabled());
    let too_many: Vec<String> = (0..17)
        .map(|i| format!(r#"{{"name": "c{i}", "match": {{"path_prefix": "/{i}"}}}}"#))
        .collect();
    let json = format!(r#"{{"hold": {{"classes": [{}]}}}}"#, too_many.join(","));
    let e = config::parse(json.as_bytes()).map(|_| ()).unwrap_err();
    assert_eq!(e.to_string(), "hold.classes: at most 16 entries");
}
