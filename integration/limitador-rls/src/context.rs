//! The CEL context of one request, built as Limitador builds it: a list binding named
//! `descriptors` holding, for each descriptor in request order, a map of its entries
//! (`key -> value`; a key repeated within one descriptor keeps its last value). Limits read it
//! as `descriptors[0]['key']` or `descriptors[0].key`.

use std::collections::HashMap;

use limitador::limit::Context;

use crate::pb::RateLimitDescriptor;

/// The binding name Limitador's conditions and variables use.
pub const DESCRIPTORS: &str = "descriptors";

/// The context of a request with these descriptors.
pub fn descriptors_context(descriptors: &[RateLimitDescriptor]) -> Context<'static> {
    let values: Vec<HashMap<String, String>> = descriptors
        .iter()
        .map(|d| {
            d.entries
                .iter()
                .map(|e| (e.key.clone(), e.value.clone()))
                .collect()
        })
        .collect();
    let mut ctx = Context::default();
    ctx.list_binding(DESCRIPTORS.to_string(), values);
    ctx
}

/// The request-level addend: `hits_addend` 0 (unset in proto3) means 1.
pub fn hits_addend(requested: u32) -> u64 {
    if requested == 0 {
        1
    } else {
        u64::from(requested)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::parse_limits;
    use crate::pb::descriptor;

    fn limit(cond: &str, var: &str) -> limitador::limit::Limit {
        let yaml = format!(
            "- namespace: d\n  max_value: 5\n  seconds: 60\n  conditions: [{cond:?}]\n  variables: [{var:?}]\n"
        );
        parse_limits(&yaml).unwrap().remove(0)
    }

    #[test]
    fn binds_each_descriptor_as_a_map() {
        let ctx = descriptors_context(&[
            descriptor([("kind", "tokens"), ("account", "acme")]),
            descriptor([("model", "gpt-x")]),
        ]);
        let l = limit(
            "descriptors[0]['kind'] == 'tokens' && descriptors[1].model == 'gpt-x'",
            "descriptors[0].account",
        );
        assert!(l.applies(&ctx));
        let vars = l.resolve_variables(&ctx).unwrap().unwrap();
        assert_eq!(
            vars.get("descriptors[0].account").map(String::as_str),
            Some("acme")
        );
    }

    #[test]
    fn a_missing_key_does_not_apply() {
        let ctx = descriptors_context(&[descriptor([("kind", "requests")])]);
        let l = limit("descriptors[0]['kind'] == 'tokens'", "descriptors[0].account");
        assert!(!l.applies(&ctx));
        let l = limit("descriptors[0]['kind'] == 'requests'", "descriptors[0].account");
        // The condition holds, but the variable has no value: Limitador makes no counter.
        assert!(l.applies(&ctx));
        assert_eq!(l.resolve_variables(&ctx).unwrap(), None);
    }

    #[test]
    fn last_value_of_a_repeated_key_wins() {
        let ctx = descriptors_context(&[descriptor([("k", "1"), ("k", "2")])]);
        assert!(limit("descriptors[0].k == '2'", "descriptors[0].k").applies(&ctx));
    }

    #[test]
    fn zero_hits_means_one() {
        assert_eq!(hits_addend(0), 1);
        assert_eq!(hits_addend(1), 1);
        assert_eq!(hits_addend(700), 700);
    }
}
