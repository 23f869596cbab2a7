"""Stat names of either artifact: the wasm module's `wasmcustom.llm_governor.pool.<pool>.<stat>`
(split into tags by STATS_TAGS) and the native module's labelled families; their Prometheus
series; and the check that a PromQL expression names both builds' series."""

from __future__ import annotations

import re
from typing import Optional

from artifacts import NATIVE

# The pool, then (hold.classes) the class: `...pool.openai.class.interactive.held` ->
# llm_governor_pool_class_held{llm_pool="openai",class="interactive"}. Envoy runs each regex on the
# name the ones before it left, so the class's matches with or without the pool in it.
STATS_TAGS = [{"tag_name": "llm_pool", "regex": r"^wasmcustom\.llm_governor\.pool\.((.+?)\.)"},
              {"tag_name": "class", "regex": r"^wasmcustom\.llm_governor\.pool\.(?:[^.]+\.)?class\.((.+?)\.)"}]
POOL_STAT_PREFIX = "llm_governor.pool."


# The native module's stats: families with labels (core/src/metrics.rs `Family`), under Envoy's
# `dynamicmodulescustom.` namespace, the pool as the label `llm_pool` (the name the wasm build's
# stats_tags give it); /stats names them with their labels, in order, after the family's name.
_NATIVE_LABELLED = (("upstream_", "upstream", "class"), ("local_reject_", "local_reject", "reason"),
                    ("exhausted_", "exhausted", "dimension"), ("fleet_calls_", "fleet_calls", "outcome"))
HISTOGRAMS = ("retry_after_ms", "hold_ms", "fleet_call_ms", "input_prediction_error_pct", "output_prediction_error_pct")
# How Envoy 1.40 prefixes each build's series in /stats/prometheus: custom wasm stats lose their
# namespace and get no envoy_ prefix; a dynamic module's keep both.
WASM_PROMETHEUS_PREFIX = "llm_governor_pool_"
NATIVE_PROMETHEUS_PREFIX = "envoy_dynamicmodulescustom_llm_governor_"


def native_family(stat: str) -> tuple:
    """(family, (label, value) or None) of the native module's stat for the wasm stat `stat`:
    `upstream_rate_limited` -> ("upstream", ("class", "rate_limited")), `held` -> ("held", None)."""
    for prefix, family, label in _NATIVE_LABELLED:
        if stat.startswith(prefix):
            return family, (label, stat[len(prefix):])
    return stat, None


def native_stat_name(pool: str, stat: str) -> str:
    """The /stats name of the native module's stat for the wasm stat `llm_governor.pool.<pool>.<stat>`
    (a hold class's `class.<class>.<stat>` is the family `class_<stat>` labelled `class`)."""
    if stat.startswith("class."):
        _, cls, rest = stat.split(".", 2)
        return f"dynamicmodulescustom.llm_governor.class_{rest}.llm_pool.{pool}.class.{cls}"
    family, label = native_family(stat)
    name = f"dynamicmodulescustom.llm_governor.{family}.llm_pool.{pool}"
    return f"{name}.{label[0]}.{label[1]}" if label else name


def native_metric(wasm_metric: str) -> tuple:
    """The native build's Prometheus series for a wasm one, as (name, matcher of the second label
    or ""): `llm_governor_pool_upstream_rate_limited` -> (`envoy_dynamicmodulescustom_llm_governor_upstream`,
    `class="rate_limited"`); `llm_governor_pool_hold_ms_bucket` -> (`..._hold_ms_bucket`, "")."""
    stat = wasm_metric.removeprefix(WASM_PROMETHEUS_PREFIX)
    suffix = ""
    for h in HISTOGRAMS:
        for s in ("_bucket", "_sum", "_count"):
            if stat == h + s:
                stat, suffix = h, s
    family, label = native_family(stat)
    return NATIVE_PROMETHEUS_PREFIX + family + suffix, (f'{label[0]}="{label[1]}"' if label else "")


def prometheus_series(pool: str, stat: str, suffix: str = "", extra: str = "", native: bool = NATIVE) -> str:
    """The /stats/prometheus series of stat `stat` of `pool` for the artifact under test (or the
    one `native` names): wasm `llm_governor_pool_<stat><suffix>{llm_pool="<pool>"<extra>}` (the
    shipped stats_tags regex); native
    `envoy_dynamicmodulescustom_llm_governor_<family><suffix>{llm_pool="<pool>"[,<label>="<v>"]<extra>}`
    (real labels; Envoy keeps the envoy_ prefix and the namespace of a dynamic module's stats).
    `suffix` is `_bucket`, `_count`, ...; `extra` more labels (`,le="2500"`)."""
    if not native:
        return f'{WASM_PROMETHEUS_PREFIX}{stat}{suffix}{{llm_pool="{pool}"{extra}}}'
    family, label = native_family(stat)
    labels = f'llm_pool="{pool}"' + (f',{label[0]}="{label[1]}"' if label else "")
    return f"{NATIVE_PROMETHEUS_PREFIX}{family}{suffix}{{{labels}{extra}}}"


# A series a query selects: an optional rate()/increase()/changes() around a metric with optional
# matchers and range. Used by `missing_native_twins`.
_SELECTION = re.compile(
    r"(?P<fn>\b(?:rate|increase|changes)\()?(?P<metric>\b[a-z_]+)(?P<sel>\{[^}]*\})?(?P<range>\[[^\]]+\])?"
)


def missing_native_twins(expr: str) -> list:
    """The wasm series `expr` (a PromQL expression) selects without its native twin right after
    it: every `f(llm_governor_pool_S{m}[r])` must read `f(llm_governor_pool_S{m}[r]) or
    f(envoy_dynamicmodulescustom_llm_governor_F{m,<label>="<v>"}[r])`, so the expression returns
    the same series from either build (and from a fleet of both: each side keeps its own
    instance's series). Returns the selections that lack it."""
    text = " ".join(expr.split())
    missing = []
    for m in _SELECTION.finditer(text):
        if not m.group("metric").startswith(WASM_PROMETHEUS_PREFIX):
            continue
        fn, sel, rng = m.group("fn") or "", m.group("sel") or "", m.group("range") or ""
        close = ")" if fn else ""
        name, label = native_metric(m.group("metric"))
        inner = sel[1:-1] if sel else ""
        matchers = ",".join(x for x in (inner, label) if x)
        twin = f"{fn}{name}{{{matchers}}}{rng}{close}" if matchers else f"{fn}{name}{rng}{close}"
        if not text[m.end():].startswith(f"{close} or {twin}"):
            missing.append(f"{m.group(0)}{close} (want: ... or {twin})")
    return missing


def wasm_stat_name(native: str) -> Optional[str]:
    """The inverse of native_stat_name (None for a name that is not one of ours)."""
    m = re.match(r"^dynamicmodulescustom\.llm_governor\.(\w+)\.llm_pool\.([a-z0-9_-]+)(?:\.(\w+)\.([\w-]+))?$", native)
    if not m:
        return None
    family, pool, label, value = m.groups()
    if family.startswith("class_") and label == "class":
        return f"{POOL_STAT_PREFIX}{pool}.class.{value}.{family[len('class_'):]}"
    stat = f"{family}_{value}" if value else family
    return f"{POOL_STAT_PREFIX}{pool}.{stat}"


def full_stat_name(name: str, native: bool) -> str:
    """The /stats name of `name`: a bare `llm_governor.pool.<pool>.<stat>` is looked up under
    `wasmcustom.` (wasm), or as the native module's labelled stat for it (native); any other
    name is Envoy's own and stays."""
    if not name.startswith(POOL_STAT_PREFIX):
        return name
    if not native:
        return "wasmcustom." + name
    pool, stat = name[len(POOL_STAT_PREFIX):].split(".", 1)
    return native_stat_name(pool, stat)
