"""Offline validation of a Kubernetes object against its CustomResourceDefinition, as the API
server would validate it on `kubectl apply`, minus the server:

1. Defaulting: `default` values of the structural schema are filled in first (the server
   defaults before it validates, and some CEL rules read defaulted fields).
2. The openAPIV3Schema, turned into JSON Schema for `jsonschema`:
   - `nullable: true` admits null; `x-kubernetes-int-or-string` admits an integer or a string;
   - an object with `properties` and without `x-kubernetes-preserve-unknown-fields` admits no
     other field (kubectl's strict field validation; the server would otherwise prune them
     silently, which is how a typo in a manifest goes unnoticed);
   - `x-kubernetes-preserve-unknown-fields` leaves an object open.
3. `x-kubernetes-list-type: map` (unique keys) and `set` (unique items).
4. Every `x-kubernetes-validations` CEL rule on a node the object has, evaluated with
   cel-python, `self` bound to that node. The Kubernetes CEL library functions the CRDs use
   (`isURL`, `url`, `getScheme`) are supplied here, after Go's `url.ParseRequestURI`, which
   Kubernetes uses. A rule using `oldSelf` (a transition rule) cannot be checked without a
   previous object and is reported as skipped; the shipped CRDs have none.

`check(obj, crds)` returns a Report: errors (path: message) and the rules evaluated.
"""

from __future__ import annotations

import copy
import re
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import celpy
import jsonschema
import yaml


@dataclass
class Report:
    errors: list = field(default_factory=list)
    rules_evaluated: list = field(default_factory=list)  # (json path, rule message)
    rules_skipped: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def load_crds(directory: Path) -> dict:
    """{(group/version, kind): openAPIV3Schema} of every CRD document in directory."""
    out = {}
    for path in sorted(directory.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            group = doc["spec"]["group"]
            kind = doc["spec"]["names"]["kind"]
            for version in doc["spec"]["versions"]:
                if version.get("served", True):
                    out[(f"{group}/{version['name']}", kind)] = version["schema"]["openAPIV3Schema"]
    return out


# --- 1. defaulting ---------------------------------------------------------------------------


def apply_defaults(schema: dict, value: Any) -> Any:
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name, sub in props.items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
        for name, sub in props.items():
            if name in value:
                value[name] = apply_defaults(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in value:
                if name not in props:
                    value[name] = apply_defaults(extra, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], item) for item in value]
    return value


# --- 2. structural schema -> JSON Schema -----------------------------------------------------


def to_json_schema(schema: dict) -> dict:
    out = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in schema:
        out["properties"] = {k: to_json_schema(v) for k, v in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in schema:
            out["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = to_json_schema(schema["additionalProperties"])
    if isinstance(schema.get("items"), dict):
        out["items"] = to_json_schema(schema["items"])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema and not schema.get("x-kubernetes-int-or-string"):
            out[key] = [to_json_schema(s) for s in schema[key]]
    if "not" in schema:
        out["not"] = to_json_schema(schema["not"])
    return out


def object_schema(spec_schema: dict) -> dict:
    """The whole object's schema: the CRD's plus the fields every object has."""
    root = copy.deepcopy(spec_schema)
    root.setdefault("properties", {})
    root["properties"].setdefault("apiVersion", {"type": "string"})
    root["properties"].setdefault("kind", {"type": "string"})
    root["properties"].setdefault("metadata", {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 253,
                     "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"},
            "namespace": {"type": "string", "maxLength": 63, "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        },
        "required": ["name"],
    })
    return root


# --- 3. list types ---------------------------------------------------------------------------


def list_type_errors(schema: dict, value: Any, path: str) -> list:
    errors = []
    if isinstance(value, list):
        kind = schema.get("x-kubernetes-list-type")
        if kind == "map":
            keys = schema.get("x-kubernetes-list-map-keys", [])
            seen = [tuple(item.get(k) for k in keys) for item in value if isinstance(item, dict)]
            if len(seen) != len(set(seen)):
                errors.append(f"{path}: duplicate entries for list-map keys {keys}")
        elif kind == "set":
            items = [repr(v) for v in value]
            if len(items) != len(set(items)):
                errors.append(f"{path}: duplicate entries in a set")
        if isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                errors += list_type_errors(schema["items"], item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                errors += list_type_errors(sub, value[name], f"{path}.{name}")
    return errors


# --- 4. CEL ----------------------------------------------------------------------------------


def _parse_request_uri(text: str) -> Optional[urllib.parse.SplitResult]:
    """Go's url.ParseRequestURI, for what it accepts: an absolute URI or an absolute path,
    no fragment, no spaces or control characters."""
    if not text or any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        return None
    if "#" in text:
        return None
    if text.startswith("/"):
        return urllib.parse.urlsplit(text)
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):(.*)$", text)
    if not match:
        return None
    rest = match.group(2)
    if not rest.startswith("/"):
        return None  # an opaque URI such as "mailto:x" is not a request URI
    parts = urllib.parse.urlsplit(text)
    if rest.startswith("//") and not parts.netloc:
        return None
    return parts


def _is_url(value) -> celpy.celtypes.BoolType:
    return celpy.celtypes.BoolType(_parse_request_uri(str(value)) is not None)


def _url(value):
    parts = _parse_request_uri(str(value))
    if parts is None:
        raise ValueError(f"URL parse error during conversion from string: {value}")
    return celpy.celtypes.MapType({celpy.celtypes.StringType("scheme"): celpy.celtypes.StringType(parts.scheme)})


def _get_scheme(url_value) -> celpy.celtypes.StringType:
    return celpy.celtypes.StringType(url_value[celpy.celtypes.StringType("scheme")])


KUBERNETES_FUNCTIONS = {"isURL": _is_url, "url": _url, "getScheme": _get_scheme}
_cel_env = celpy.Environment()
_programs: dict = {}


def eval_rule(rule: str, value: Any) -> Any:
    if rule not in _programs:
        _programs[rule] = _cel_env.program(_cel_env.compile(rule), functions=KUBERNETES_FUNCTIONS)
    return _programs[rule].evaluate({"self": celpy.json_to_cel(value)})


def cel_errors(schema: dict, value: Any, path: str, report: Report) -> None:
    for validation in schema.get("x-kubernetes-validations", []):
        rule = validation["rule"]
        message = validation.get("message") or f"failed rule: {rule}"
        if re.search(r"\boldSelf\b", rule):
            report.rules_skipped.append((path, message))
            continue
        try:
            result = eval_rule(rule, value)
        except Exception as err:  # a rule that cannot be evaluated is a failure, not a pass
            report.errors.append(f"{path}: CEL rule could not be evaluated ({err}): {rule}")
            continue
        report.rules_evaluated.append((path, message))
        if isinstance(result, Exception) or result is not True and result != celpy.celtypes.BoolType(True):
            report.errors.append(f"{path}: {message}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name, sub in props.items():
            if name in value:
                cel_errors(sub, value[name], f"{path}.{name}", report)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in value:
                if name not in props:
                    cel_errors(extra, value[name], f"{path}.{name}", report)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            cel_errors(schema["items"], item, f"{path}[{i}]", report)


# --- all of it -------------------------------------------------------------------------------


def check(obj: dict, crds: dict) -> Report:
    report = Report()
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key not in crds:
        report.errors.append(f"no served CRD version for apiVersion {key[0]} kind {key[1]}")
        return report
    schema = object_schema(crds[key])
    obj = apply_defaults(schema, copy.deepcopy(obj))
    validator = jsonschema.Draft7Validator(to_json_schema(schema))
    for error in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path)):
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        report.errors.append(f"{where or '.'}: {error.message}")
    report.errors += list_type_errors(schema, obj, "")
    if not report.errors:  # CEL runs on values the schema accepted, as the server does
        cel_errors(schema, obj, "", report)
    return report
