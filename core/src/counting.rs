//! What each provider counts against its limits, one rule per provider, from its own
//! documentation (`shared/reference/counting.md`), pure and tested by one table
//! (`core/tests/counting.rs`: dialect × usage shape → what each dimension counts):
//!
//! - Anthropic: input = `input_tokens + cache_creation_input_tokens` (cache reads only where the
//!   operator says its model counts them: `count_cache_reads`); output = the tokens generated.
//! - OpenAI and Azure OpenAI: a request counts at admission as the larger of its estimated input
//!   and its characters / 4 (cached input included), plus its output limit, never adjusted.
//! - Gemini: input = `promptTokenCount` (cached content included), output = the rest of
//!   `totalTokenCount` (candidates and thoughts), from `usageMetadata`.
//!
//! Before the call, what a reserving limit takes follows the same rule: where the provider
//! counts the tokens generated, the output is predicted from recent usage (`predict`), never
//! `max_tokens`; where it reads a prompt prefix from its cache, that prefix is not counted
//! (`prefix`, `prefix_cache`).

use crate::classify::Dialect;
use crate::config::{Counts, Limit, OutputRule, Settle};
use crate::estimate::Estimate;
use crate::usage::Usage;

/// What a provider counts of one request, by dimension.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Count {
    pub input: u64,
    pub output: u64,
}

impl Count {
    /// What a limit counting `counts` takes of it.
    pub fn of(&self, counts: Counts) -> u64 {
        match counts {
            Counts::Tokens => self.input.saturating_add(self.output),
            Counts::InputTokens => self.input,
            Counts::OutputTokens => self.output,
        }
    }
}

/// What the provider of `dialect` counts of a request whose answer reported `usage`
/// (`cache_reads`: the model counts cache reads as input, Anthropic's † models). None when the
/// usage says nothing it counts.
pub fn counted(dialect: Dialect, usage: &Usage, cache_reads: bool) -> Option<Count> {
    let Usage {
        input,
        output,
        total,
        cache_write,
        cache_read,
    } = *usage;
    match dialect {
        Dialect::Anthropic => {
            let read = if cache_reads { cache_read } else { None };
            if input.is_none() && output.is_none() && cache_write.is_none() && read.is_none() {
                return total.map(|t| Count {
                    input: t,
                    output: 0,
                });
            }
            let input = [input, cache_write, read]
                .into_iter()
                .flatten()
                .fold(0u64, u64::saturating_add);
            Some(Count {
                input,
                output: output.unwrap_or(0),
            })
        }
        // Gemini's total includes thinking tokens its candidates count leaves out.
        Dialect::Gemini => match (input, output, total) {
            (None, None, None) => None,
            (i, o, Some(t)) => {
                let i = i.unwrap_or(0).min(t);
                Some(Count {
                    input: i,
                    output: (t - i).max(o.unwrap_or(0)),
                })
            }
            (i, o, None) => Some(Count {
                input: i.unwrap_or(0),
                output: o.unwrap_or(0),
            }),
        },
        // OpenAI's prompt tokens include the cached ones, as its limiter counts them.
        Dialect::OpenAi | Dialect::AzureOpenAi | Dialect::Auto => match (input, output, total) {
            (None, None, None) => None,
            (None, None, Some(t)) => Some(Count {
                input: t,
                output: 0,
            }),
            (i, o, _) => Some(Count {
                input: i.unwrap_or(0),
                output: o.unwrap_or(0),
            }),
        },
    }
}

/// Whether the provider counts output as the tokens it generates (Anthropic, Gemini), rather
/// than the request's output limit at admission (OpenAI, Azure OpenAI).
pub fn counts_generated_output(dialect: Dialect) -> bool {
    matches!(dialect, Dialect::Anthropic | Dialect::Gemini)
}

/// Whether the provider reads prompt prefixes marked with `cache_control` from its cache.
pub fn caches_prompts(dialect: Dialect) -> bool {
    dialect == Dialect::Anthropic
}

/// What was predicted, before the call, of what the provider will count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Prediction {
    /// The input tokens after the longest prefix predicted to be read from the cache (None:
    /// none is).
    pub uncached_input: Option<u64>,
    /// The index of that prefix among the prompt's candidates.
    pub hit: Option<usize>,
    /// A high quantile of recent output of the request's (pool, model) (None: none seen yet).
    pub output: Option<u64>,
    /// The learned ratio of the input the provider counts to the filter's estimate, per
    /// mille (None: not learned yet; providers that count generated output only).
    pub input_per_mille: Option<u64>,
}

/// `tokens` of the filter's estimate, as the provider's tokenizer counts them (`per_mille`).
pub fn scaled(tokens: u64, per_mille: Option<u64>) -> u64 {
    match per_mille {
        Some(r) => u64::try_from(u128::from(tokens) * u128::from(r) / 1000).unwrap_or(u64::MAX),
        None => tokens,
    }
}

/// What a reserving limit takes before the call: `amount`, of which `firm` is counted by rule
/// (the input, an output limit) and the rest predicted. A request whose firm part is larger
/// than the limit's burst can never be admitted; a prediction larger than the burst is cut to
/// it (the provider would admit the request into a full bucket).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reserve {
    pub amount: u64,
    pub firm: u64,
}

/// The count a reserving limit takes of a request (`settle` as resolved for its dialect):
/// - `Reservation` (OpenAI's rule): the larger of the estimate and the body's characters / 4,
///   plus the output limit (`default_output_tokens` when it sets none);
/// - otherwise the estimated input (scaled by the learned ratio to the provider's count), less
///   a prefix predicted to be read from the cache (unless cache reads count), plus, where the provider counts tokens generated and the limit does
///   not say `output: "max_tokens"`, the predicted output (at least `min_output_tokens`, never
///   more than the output limit; before any usage was seen, the output limit up to
///   `default_output_tokens`), else the output limit.
pub fn reservation(
    limit: &Limit,
    settle: Settle,
    dialect: Dialect,
    est: &Estimate,
    predicted: &Prediction,
) -> Reserve {
    let output_limit = est.max_output.unwrap_or(limit.default_output_tokens);
    let by_rule = settle == Settle::Reservation;
    let input = match predicted.uncached_input {
        _ if by_rule => est.input_by_characters(),
        Some(uncached) if !limit.count_cache_reads => uncached,
        _ => est.input,
    };
    let input = match by_rule {
        true => input,
        false => scaled(input, predicted.input_per_mille),
    };
    let predicts_output =
        !by_rule && limit.output == OutputRule::Generated && counts_generated_output(dialect);
    let output = match predicted.output {
        _ if !predicts_output => output_limit,
        Some(p) => p.max(limit.min_output_tokens).min(output_limit),
        None => output_limit.min(limit.default_output_tokens),
    };
    let count = Count { input, output };
    let amount = count.of(limit.counts);
    let firm = match predicts_output {
        true => Count { output: 0, ..count }.of(limit.counts),
        false => amount,
    };
    Reserve {
        amount: amount.min(limit.burst.max(firm)),
        firm,
    }
}
