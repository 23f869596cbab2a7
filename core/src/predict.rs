//! Predicting, before the call, what the provider will count, and learning from what it
//! reported: the cache reads of a prompt (`prefix_cache`), and the output of a request where
//! the provider counts the tokens generated, a high quantile of the recent outputs of its
//! (pool, model) kept in shared data (`Recent`, one fixed-width record per pair, counted
//! against `max_keys`). Every prediction is settled with the usage at the stream's end
//! (`limits`); its error is a histogram (`input_prediction_error_pct`,
//! `output_prediction_error_pct`).

use crate::config::{Config, LimitKind, OutputRule};
use crate::counting::{self, Prediction};
use crate::env::Env;
use crate::keys;
use crate::keyspace;
use crate::metrics::Histogram;
use crate::prefix_cache;
use crate::request::Flow;
use crate::store::{Reader, Record, Writer};
use crate::usage::Usage;

/// Outputs remembered per (pool, model).
pub const SAMPLES: usize = 32;
/// The quantile reserved: the 90th percentile of the recent outputs.
const QUANTILE_PCT: usize = 90;
/// Input ratios remembered per (pool, model); the median of them scales the estimate once
/// `MIN_RATIOS` are in.
pub const RATIOS: usize = 16;
const MIN_RATIOS: usize = 4;
/// A ratio is learned from a prediction of at least this many tokens (smaller ones are noise).
const MIN_RATIO_BASE: u64 = 16;
/// The estimate is scaled by at most this much either way (per mille).
const RATIO_RANGE: (u64, u64) = (500, 2000);
const ENCODED_LEN: usize = SAMPLES * 4 + 2 + RATIOS * 2 + 2;

/// The recent outputs of a (pool, model), oldest overwritten first; and the recent ratios of
/// the input the provider counted to the filter's estimate of it (the estimate is a heuristic,
/// the provider's tokenizer its own: the median ratio calibrates one to the other).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recent {
    samples: [u32; SAMPLES],
    len: u8,
    next: u8,
    ratios: [u16; RATIOS],
    ratios_len: u8,
    ratios_next: u8,
}

impl Recent {
    /// One more ratio of counted to estimated input, per mille.
    pub fn with_ratio(mut self, per_mille: u64) -> Recent {
        let at = usize::from(self.ratios_next) % RATIOS;
        self.ratios[at] = per_mille.clamp(RATIO_RANGE.0, RATIO_RANGE.1) as u16;
        self.ratios_next = ((at + 1) % RATIOS) as u8;
        self.ratios_len = (usize::from(self.ratios_len) + 1).min(RATIOS) as u8;
        self
    }

    /// The median ratio, per mille, once enough are in.
    pub fn ratio(&self) -> Option<u64> {
        let n = usize::from(self.ratios_len).min(RATIOS);
        if n < MIN_RATIOS {
            return None;
        }
        let mut seen = self.ratios;
        let seen = &mut seen[..n];
        seen.sort_unstable();
        Some(u64::from(seen[n / 2]))
    }

    pub fn with(mut self, output: u64) -> Recent {
        let at = usize::from(self.next) % SAMPLES;
        self.samples[at] = u32::try_from(output).unwrap_or(u32::MAX);
        self.next = ((at + 1) % SAMPLES) as u8;
        self.len = (usize::from(self.len) + 1).min(SAMPLES) as u8;
        self
    }

    /// The `QUANTILE_PCT` quantile of what was seen (nearest rank); None before anything was.
    pub fn quantile(&self) -> Option<u64> {
        let n = usize::from(self.len).min(SAMPLES);
        if n == 0 {
            return None;
        }
        let mut seen = self.samples;
        let seen = &mut seen[..n];
        seen.sort_unstable();
        let rank = (n * QUANTILE_PCT).div_ceil(100).clamp(1, n);
        Some(u64::from(seen[rank - 1]))
    }
}

impl Record for Recent {
    fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(ENCODED_LEN);
        for s in self.samples {
            out.extend_from_slice(&s.to_le_bytes());
        }
        out.extend_from_slice(&Writer::<2>::default().u8(self.len).u8(self.next).done());
        for r in self.ratios {
            out.extend_from_slice(&r.to_le_bytes());
        }
        out.extend_from_slice(
            &Writer::<2>::default()
                .u8(self.ratios_len)
                .u8(self.ratios_next)
                .done(),
        );
        out
    }

    fn from_bytes(bytes: &[u8]) -> Option<Recent> {
        let mut r = Reader::exact(bytes, ENCODED_LEN)?;
        let mut recent = Recent::default();
        for s in &mut recent.samples {
            *s = r.u32()?;
        }
        recent.len = r.u8()?.min(SAMPLES as u8);
        recent.next = r.u8()? % SAMPLES as u8;
        for x in &mut recent.ratios {
            *x = r.u16()?;
        }
        recent.ratios_len = r.u8()?.min(RATIOS as u8);
        recent.ratios_next = r.u8()? % RATIOS as u8;
        Some(recent)
    }
}

/// What the configuration's reserving token limits need predicted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Needs {
    /// Some limit counts input without the provider's cache reads.
    pub cache_reads: bool,
    /// Some limit counts output as generated (`output: "generated"`).
    pub output: bool,
}

impl Needs {
    pub fn of(cfg: &Config) -> Needs {
        let reserving = || {
            cfg.limits
                .iter()
                .filter(|l| l.kind == LimitKind::Tokens && l.reserve)
        };
        Needs {
            cache_reads: reserving().any(|l| l.counts.input() && !l.count_cache_reads),
            output: reserving().any(|l| l.counts.output() && l.output == OutputRule::Generated),
        }
    }

    fn any(&self) -> bool {
        self.cache_reads || self.output
    }
}

/// Predict what the provider will count of the flow's request, for the limits that reserve:
/// the prefix of its prompt read from the cache, its output. Read-only; at most two reads of
/// shared data, and none for a request whose dialect counts neither.
pub(crate) fn before(cfg: &Config, needs: Needs, flow: &mut Flow, env: &Env) {
    if !needs.any() || flow.estimate.is_none() {
        return;
    }
    let mut p = Prediction::default();
    if needs.cache_reads && counting::caches_prompts(flow.dialect) {
        if let Some(prompt) = &flow.prompt {
            p.hit = prefix_cache::lookup(env, flow.account, flow.model_id, prompt);
            p.uncached_input = p
                .hit
                .and_then(|i| prompt.candidates.get(i))
                .map(|c| c.uncached);
        }
    }
    if counting::counts_generated_output(flow.dialect) {
        let key = keys::usage_key(&cfg.pools[flow.pool].name, flow.model_id);
        if let Ok(Some((bytes, _))) = env.store.get(&key) {
            let recent = Recent::from_bytes(&bytes).unwrap_or_default();
            p.output = recent.quantile().filter(|_| needs.output);
            p.input_per_mille = recent.ratio();
        }
    }
    flow.predicted = Some(Box::new(p));
}

/// The provider answered the flow's request with success: its prompt's breakpoints are in the
/// cache now, and the prefix it read was renewed.
pub(crate) fn on_success(cfg: &Config, flow: &Flow, env: &mut Env) {
    let Some(prompt) = &flow.prompt else { return };
    if !counting::caches_prompts(flow.dialect) {
        return;
    }
    let ids = (flow.account, flow.model_id);
    prefix_cache::remember(
        env,
        cfg.max_keys,
        flow.pool,
        ids,
        prompt,
        flow.prediction().hit,
    );
}

/// The stream ended with `usage`: learn its output, and record how far the predictions were
/// from what the provider counted.
pub(crate) fn learn(cfg: &Config, needs: Needs, flow: &Flow, usage: &Usage, env: &mut Env) {
    if !needs.any() || flow.estimate.is_none() {
        return;
    }
    let Some(count) = counting::counted(flow.dialect, usage, false) else {
        return;
    };
    let Some(est) = flow.estimate else { return };
    let p = flow.prediction();
    // The input as predicted for the limits that reserve it (what a cache read leaves), before
    // and after the learned scale.
    let raw = p.uncached_input.unwrap_or(est.input);
    if needs.cache_reads {
        let err = error_pct(counting::scaled(raw, p.input_per_mille), count.input);
        env.metrics
            .histogram(flow.pool, Histogram::InputPredictionErrorPct, err);
    }
    if !counting::counts_generated_output(flow.dialect) {
        return;
    }
    // A ratio is learned only where the cache did what was predicted: a usage that
    // contradicts the prediction (a read where none was predicted, or none where one was)
    // says nothing of the estimate's scale.
    let read = usage.cache_read.unwrap_or(0) > 0;
    let agrees = !counting::caches_prompts(flow.dialect) || read == p.hit.is_some();
    let ratio = (agrees && raw >= MIN_RATIO_BASE).then(|| count.input.saturating_mul(1000) / raw);
    let output = (needs.output && usage.output.is_some()).then_some(count.output);
    if let (Some(predicted), Some(actual)) = (p.output, output) {
        env.metrics.histogram(
            flow.pool,
            Histogram::OutputPredictionErrorPct,
            error_pct(predicted, actual),
        );
    }
    if ratio.is_none() && output.is_none() {
        return;
    }
    let key = keys::usage_key(&cfg.pools[flow.pool].name, flow.model_id);
    let pool = flow.pool;
    if !keyspace::key_exists_or_admit(cfg.max_keys, &key, keys::BUCKET_KEY_COUNT, pool, env) {
        return;
    }
    let empty = Recent::default();
    keyspace::modify(env, pool, &key, None, Some(&empty), |r: Option<Recent>| {
        let mut r = r.unwrap_or_default();
        if let Some(o) = output {
            r = r.with(o);
        }
        if let Some(x) = ratio {
            r = r.with_ratio(x);
        }
        (Some(r), ())
    });
}

/// |predicted - actual| in percent of actual (of 1 when the provider counted nothing).
pub fn error_pct(predicted: u64, actual: u64) -> u64 {
    let diff = u128::from(predicted.abs_diff(actual)) * 100;
    u64::try_from(diff / u128::from(actual.max(1))).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quantile_of_recent_outputs() {
        assert_eq!(Recent::default().quantile(), None);
        let r = (1..=10).fold(Recent::default(), |r, n| r.with(n * 10));
        assert_eq!(r.quantile(), Some(90));
        // Only the last SAMPLES count: 40 small answers after a long one forget it.
        let r = (0..40).fold(Recent::default().with(16_000), |r, _| r.with(100));
        assert_eq!(r.quantile(), Some(100));
        assert_eq!(Recent::from_bytes(&r.to_bytes()), Some(r.clone()));
        // The median ratio, once four are in, within its range.
        let r = [1300, 1400, 1350].iter().fold(r, |r, x| r.with_ratio(*x));
        assert_eq!(r.ratio(), None);
        let r = r.with_ratio(90_000);
        assert_eq!(r.ratio(), Some(1400));
        assert_eq!(Recent::from_bytes(&r.to_bytes()), Some(r));
        assert_eq!(Recent::from_bytes(&[0; 3]), None);
        assert_eq!(error_pct(110, 100), 10);
        assert_eq!(error_pct(90, 100), 10);
        assert_eq!(error_pct(5, 0), 500);
    }
}
