"""The Kubernetes manifests in deploy/: valid for the real CRDs, carrying a configuration the
module accepts, pinned to the image of the module under test.

- Every WasmPlugin, EnvoyExtensionPolicy and EnvoyProxy in deploy/ (the wasm build's and, in
  deploy/envoy-gateway-native/, the native build's) against the CRD schemas in ../shared/crds
  (openAPIV3Schema with strict fields, list types, and every CEL rule on a node the manifest
  has: integration/e2e/crd_check.py). A control per kind of drift shows the check can fail.
- The filter configuration each manifest embeds is loaded by the module itself, the way
  `make validate` loads the shipped configs: `envoy --mode validate` on a bootstrap carrying it,
  which runs on_configure. The EnvoyFilter's whole Wasm config and the EnvoyPatchPolicy's
  result (applied to a listener shaped as Envoy Gateway generates it) go through Envoy too.
- The `sha256` every manifest pins is the digest `make image` gives the module under test,
  and the plugin configuration is the README's example, the same in every manifest.

- The native build's manifests name the module file, filter and do_not_close as
  envoy/native.yaml does, and the filter Envoy Gateway generates from them (module by absolute
  path, the config as a StringValue) loads the dynamic module in `envoy --mode validate`.

EnvoyFilter, EnvoyPatchPolicy, Gateway and ConfigMap have no CRD schema here (not in
../shared/crds): they are checked through Envoy as above, and their fields by the tests below.

Everything here is checked once, in the wasm pass: the manifests are the same files whatever
the artifact under test, and the tests of the native manifests load NATIVE_MODULE (built by
`make test` before either pass) by its path.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import crd_check
from harness import (
    NATIVE_MODULE,
    REPO_ROOT,
    STATS_TAGS,
    WASM_MODULE,
    envoy_bootstrap,
    find_envoy,
    wasm_filter,
    wasm_only,
)

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import oci_image  # noqa: E402

# The same files whatever the artifact: checked once, in the wasm pass (see above).
pytestmark = wasm_only("deploy/ is checked once; its native manifests' tests load the .so by path")

DEPLOY = REPO_ROOT / "deploy"
CRD_DIR = Path(os.environ.get("LLM_GOVERNOR_CRDS") or REPO_ROOT.parent / "shared" / "crds")
# Kinds with a CRD schema in ../shared/crds: every object of these kinds in deploy/ is checked.
CRD_KINDS = ("WasmPlugin", "EnvoyExtensionPolicy", "EnvoyProxy")
EG_WASM_FILTER = "envoy.filters.http.wasm/envoyextensionpolicy/llm-gateway/llm-governor/wasm/0"
EG_NATIVE_FILTER = (
    "envoy.filters.http.dynamic_modules/envoyextensionpolicy/llm-gateway/llm-governor/dynamic-module/0"
)
DYNAMIC_MODULE_FILTER = "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter"
NATIVE_DIR = DEPLOY / "envoy-gateway-native"

# Manifests by "<folder under deploy/>/<kind>".
ISTIO_PLUGIN = "istio/WasmPlugin"
EG_POLICY = "envoy-gateway/EnvoyExtensionPolicy"
EG_PROXY = "envoy-gateway/EnvoyProxy"
NATIVE_POLICY = "envoy-gateway-native/EnvoyExtensionPolicy"
NATIVE_PROXY = "envoy-gateway-native/EnvoyProxy"


def documents(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_objects() -> list:
    out = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for doc in documents(path):
            out.append((path, doc))
    return out


def manifest_id(path: Path, doc: dict) -> str:
    return f"{path.parent.relative_to(DEPLOY)}/{doc.get('kind')}"


def one(manifest: str) -> dict:
    """The one object of a kind in a folder of deploy/: one("envoy-gateway/EnvoyProxy")."""
    found = [doc for path, doc in all_objects() if manifest_id(path, doc) == manifest]
    assert len(found) == 1, f"expected one {manifest} in deploy/, found {len(found)}"
    return found[0]


# Collected from the files, so a new manifest of a CRD kind is checked without being listed.
SCHEMA_CHECKED = sorted({manifest_id(path, doc) for path, doc in all_objects() if doc.get("kind") in CRD_KINDS})


@pytest.fixture(scope="module")
def crds() -> dict:
    if not CRD_DIR.is_dir():
        message = f"CRD schemas not found at {CRD_DIR} (the shared/crds folder beside the repository; or set LLM_GOVERNOR_CRDS)"
        if os.environ.get("CI") == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    loaded = crd_check.load_crds(CRD_DIR)
    assert {kind for _, kind in loaded} >= set(CRD_KINDS), loaded.keys()
    return loaded


def readme_example_config() -> dict:
    text = (REPO_ROOT / "README.md").read_text()
    section = text.split("\n## Configuration\n", 1)[1]
    block = re.search(r"```json\n(.*?)\n```", section, re.S)
    assert block, "README's Configuration section has no ```json example"
    return json.loads(block.group(1))


def envoy_validate(http_filter: dict, tmp_path: Path, bootstrap: dict = None) -> subprocess.CompletedProcess:
    """`envoy --mode validate` on a bootstrap with http_filter before the router, as
    scripts/validate.sh runs it: the module is loaded and its on_configure runs. Without
    ENVOY_DYNAMIC_MODULES_SEARCH_PATH: a dynamic module loads from the path its config names."""
    boot = bootstrap or envoy_bootstrap(upstream_port=9, http_filters=[http_filter])
    path = tmp_path / f"validate-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(boot))
    env = {k: v for k, v in os.environ.items() if k != "ENVOY_DYNAMIC_MODULES_SEARCH_PATH"}
    return subprocess.run(
        [find_envoy(), "--mode", "validate", "--config-path", str(path), "--disable-hot-restart", "--log-level", "warn"],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT, env=env,
    )


def assert_accepted(result: subprocess.CompletedProcess, what: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"envoy --mode validate refused {what}:\n{output[-3000:]}"
    assert "invalid configuration" not in output, output[-3000:]
    assert not [l for l in output.splitlines() if "[critical]" in l], output[-3000:]


# --- the manifests against the CRDs ----------------------------------------------------------


def test_every_manifest_in_deploy_is_a_known_kind():
    manifests = sorted(manifest_id(path, doc) for path, doc in all_objects())
    assert manifests == sorted([
        "istio/WasmPlugin", "istio/EnvoyFilter", "istio/ConfigMap", "istio/Gateway",
        "envoy-gateway/Gateway", EG_POLICY, EG_PROXY, "envoy-gateway/EnvoyPatchPolicy",
        NATIVE_POLICY, NATIVE_PROXY,
    ]), manifests
    assert SCHEMA_CHECKED == sorted([ISTIO_PLUGIN, EG_POLICY, EG_PROXY, NATIVE_POLICY, NATIVE_PROXY])


@pytest.mark.parametrize("manifest", SCHEMA_CHECKED)
def test_manifest_is_valid_for_its_crd(manifest, crds):
    report = crd_check.check(one(manifest), crds)
    assert report.ok, "\n".join(report.errors)
    assert report.rules_evaluated, f"no CEL rule of {manifest}'s CRD was evaluated"
    assert not report.rules_skipped, report.rules_skipped


def test_the_cel_rules_that_apply_are_evaluated(crds):
    # Which rules each manifest is checked against (the README's Deploy section lists them).
    covered = {m: {msg for _, msg in crd_check.check(one(m), crds).rules_evaluated} for m in SCHEMA_CHECKED}
    assert covered[ISTIO_PLUGIN] >= {
        "only one of targetRefs or selector can be set",
        "url must have schema one of [http, https, file, oci]",
        "value may only be set when valueFrom is INLINE",
    }
    targets = {
        "either targetRef or targetRefs must be used",
        "this policy can only have a targetRefs[*].group of gateway.networking.k8s.io",
    }
    assert covered[EG_POLICY] >= targets | {
        "If type is Image, image field needs to be set.",
        "If type is HTTP, http field needs to be set.",
    }
    assert covered[NATIVE_POLICY] >= targets
    assert "Either image or imageRepository can be set." in covered[EG_PROXY]
    assert covered[NATIVE_PROXY] >= {
        "Either image or imageRepository can be set.",
        "If type is Remote, remote field needs to be set.",
        "If type is Local, local field needs to be set.",
        "If type is Remote, local field must not be set.",
        "Image must include a tag and allowed characters only (e.g., 'repo:tag').",
    }


def drifted(manifest: str, edit) -> dict:
    doc = copy.deepcopy(one(manifest))
    edit(doc)
    return doc


def native_module_entry(doc: dict) -> dict:
    return doc["spec"]["dynamicModules"][0]


DRIFTS = [
    (ISTIO_PLUGIN, "unknown field", lambda d: d["spec"].update(failStratgy="FAIL_OPEN"), "'failStratgy' was unexpected"),
    (ISTIO_PLUGIN, "enum", lambda d: d["spec"].update(failStrategy="FAIL_SOMETIMES"), "is not one of"),
    (ISTIO_PLUGIN, "pattern", lambda d: d["spec"].update(sha256="sha256:" + "0" * 64), "does not match"),
    (ISTIO_PLUGIN, "CEL: selector and targetRefs",
     lambda d: d["spec"].update(selector={"matchLabels": {"istio": "ingressgateway"}}),
     "only one of targetRefs or selector can be set"),
    (ISTIO_PLUGIN, "CEL: url scheme", lambda d: d["spec"].update(url="ftp://registry.example.com/llm-governor"),
     "url must have schema one of"),
    (ISTIO_PLUGIN, "CEL: HOST env with a value", lambda d: d["spec"]["vmConfig"]["env"][0].update(value="secret"),
     "value may only be set when valueFrom is INLINE"),
    (EG_POLICY, "unknown field", lambda d: d["spec"]["wasm"][0].update(failopen=True), "'failopen' was unexpected"),
    (EG_POLICY, "type", lambda d: d["spec"]["wasm"][0].update(failOpen="yes"), "is not of type 'boolean'"),
    (EG_POLICY, "CEL: Image without image",
     lambda d: d["spec"]["wasm"][0]["code"].update(type="HTTP"), "If type is HTTP, http field needs to be set."),
    (EG_POLICY, "CEL: targetRefs group",
     lambda d: d["spec"]["targetRefs"][0].update(group="networking.istio.io"), "targetRefs[*].group of gateway.networking.k8s.io"),
    (EG_POLICY, "CEL: no target", lambda d: d["spec"].pop("targetRefs"), "either targetRef or targetRefs must be used"),
    (EG_PROXY, "enum", lambda d: d["spec"]["bootstrap"].update(type="Overwrite"), "is not one of"),
    (EG_PROXY, "CEL: image and imageRepository",
     lambda d: d["spec"]["provider"]["kubernetes"]["envoyDeployment"]["container"].update(
         image="envoyproxy/envoy:v1.40-latest", imageRepository="envoyproxy/envoy"),
     "Either image or imageRepository can be set."),
    # The native build's: the registry entry in the EnvoyProxy, the filter in the policy.
    (NATIVE_PROXY, "unknown field (Envoy's spelling)", lambda d: native_module_entry(d).update(do_not_close=True),
     "'do_not_close' was unexpected"),
    (NATIVE_PROXY, "type", lambda d: native_module_entry(d).update(doNotClose="true"), "is not of type 'boolean'"),
    (NATIVE_PROXY, "pattern (the file's name)", lambda d: native_module_entry(d).update(name="llm_governor"),
     "does not match"),
    (NATIVE_PROXY, "required", lambda d: native_module_entry(d)["source"]["local"].pop("path"),
     "'path' is a required property"),
    (NATIVE_PROXY, "enum", lambda d: native_module_entry(d)["source"].update(type="Image"), "is not one of"),
    (NATIVE_PROXY, "list-map keys", lambda d: d["spec"]["dynamicModules"].append(copy.deepcopy(native_module_entry(d))),
     "duplicate entries for list-map keys ['name']"),
    (NATIVE_PROXY, "CEL: Local without local", lambda d: native_module_entry(d)["source"].pop("local"),
     "If type is Local, local field needs to be set."),
    (NATIVE_PROXY, "CEL: Remote without remote", lambda d: native_module_entry(d)["source"].update(type="Remote"),
     "If type is Remote, remote field needs to be set."),
    (NATIVE_PROXY, "CEL: Remote with local",
     lambda d: native_module_entry(d)["source"].update(
         type="Remote", remote={"url": "https://registry.example.com/libllm_governor.so", "sha256": "0" * 64}),
     "If type is Remote, local field must not be set."),
    (NATIVE_PROXY, "pattern (remote sha256)",
     lambda d: native_module_entry(d).update(source={"type": "Remote", "remote": {
         "url": "https://registry.example.com/libllm_governor.so", "sha256": "sha256:" + "0" * 64}}),
     "does not match"),
    (NATIVE_PROXY, "CEL: image as a URL",
     lambda d: d["spec"]["provider"]["kubernetes"]["envoyDeployment"]["container"].update(
         image="https://registry.example.com/llm-governor-envoy:0.1.0"),
     "Image must include a tag and allowed characters only"),
    (NATIVE_POLICY, "unknown field (Envoy's spelling)", lambda d: d["spec"]["dynamicModule"][0].update(filter_name="llm_governor"),
     "'filter_name' was unexpected"),
    (NATIVE_POLICY, "pattern (the file's name)", lambda d: d["spec"]["dynamicModule"][0].update(name="llm_governor"),
     "does not match"),
    (NATIVE_POLICY, "required", lambda d: d["spec"]["dynamicModule"][0].pop("name"), "'name' is a required property"),
    (NATIVE_POLICY, "CEL: targetRefs group",
     lambda d: d["spec"]["targetRefs"][0].update(group="gateway.envoyproxy.io"), "targetRefs[*].group of gateway.networking.k8s.io"),
]


@pytest.mark.parametrize("manifest,what,edit,expected", DRIFTS, ids=[f"{m}: {w}" for m, w, _, _ in DRIFTS])
def test_a_drifted_manifest_is_refused(manifest, what, edit, expected, crds):
    report = crd_check.check(drifted(manifest, edit), crds)
    assert not report.ok, f"{manifest} with a {what} drift passed"
    assert any(expected in e for e in report.errors), report.errors


def test_every_schema_checked_manifest_has_drift_controls():
    assert {m for m, _, _, _ in DRIFTS} == set(SCHEMA_CHECKED)


def test_crd_defaults_are_applied_before_the_rules(crds):
    # pullSecretRef.kind defaults to Secret, and its CEL rule reads it: a manifest that names
    # only the Secret's name passes, as the API server would accept it.
    doc = drifted(EG_POLICY, lambda d: d["spec"]["wasm"][0]["code"]["image"].update(
        pullSecretRef={"name": "registry-credentials"}))
    assert crd_check.check(doc, crds).ok
    doc["spec"]["wasm"][0]["code"]["image"]["pullSecretRef"]["kind"] = "ConfigMap"
    assert "only support Secret kind." in " ".join(crd_check.check(doc, crds).errors)


def test_the_module_source_type_defaults_to_local_before_the_rules(crds):
    # source.type defaults to Local and two CEL rules read it: without the type the entry
    # passes as Local, and is refused as Local without `local`.
    doc = drifted(NATIVE_PROXY, lambda d: native_module_entry(d)["source"].pop("type"))
    assert crd_check.check(doc, crds).ok
    native_module_entry(doc)["source"].pop("local")
    assert "If type is Local, local field needs to be set." in " ".join(crd_check.check(doc, crds).errors)


# --- the configuration the module gets ------------------------------------------------------


def istio_plugin_config() -> dict:
    return one(ISTIO_PLUGIN)["spec"]["pluginConfig"]


def eg_plugin_config() -> dict:
    return one(EG_POLICY)["spec"]["wasm"][0]["config"]


def envoyfilter_wasm() -> dict:
    patches = one("istio/EnvoyFilter")["spec"]["configPatches"]
    ecds = [p for p in patches if p["applyTo"] == "EXTENSION_CONFIG"]
    assert len(ecds) == 1, patches
    return ecds[0]["patch"]["value"]


def test_every_manifest_carries_the_readme_example_config():
    example = readme_example_config()
    assert istio_plugin_config() == example
    assert eg_plugin_config() == example
    assert native_policy_filter()["config"] == example
    wasm = envoyfilter_wasm()["typed_config"]["config"]
    assert json.loads(wasm["configuration"]["value"]) == example


@pytest.mark.parametrize("source", ["WasmPlugin", "EnvoyExtensionPolicy"])
def test_the_module_accepts_the_embedded_config(source, tmp_path):
    config = istio_plugin_config() if source == "WasmPlugin" else eg_plugin_config()
    # As Istio and EG generate the filter: no allow_on_headers_stop_iteration.
    result = envoy_validate(wasm_filter(json.dumps(config), allow_on_headers_stop_iteration=False), tmp_path)
    assert_accepted(result, f"the {source}'s configuration")


def test_a_config_the_module_refuses_fails_validation(tmp_path):
    # The control: the same path with a value the module refuses must fail, naming the field.
    config = copy.deepcopy(istio_plugin_config())
    config["limits"][0]["requests_per_minute"] = 0
    result = envoy_validate(wasm_filter(json.dumps(config)), tmp_path)
    assert result.returncode != 0
    assert "limits[0].requests_per_minute" in result.stdout + result.stderr, (result.stdout + result.stderr)[-2000:]


def local_code(wasm_typed_config: dict) -> dict:
    """The Wasm config with its remote code turned into the module file, as Istio's agent and
    the EG controller hand it to Envoy."""
    config = copy.deepcopy(wasm_typed_config)
    config["config"]["vm_config"]["code"] = {"local": {"filename": str(WASM_MODULE)}}
    return config


def test_the_envoyfilter_wasm_config_loads_in_envoy_with_stop_iteration_on(tmp_path):
    ecds = envoyfilter_wasm()
    typed = ecds["typed_config"]
    assert typed["@type"] == "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
    plugin = typed["config"]
    assert plugin["allow_on_headers_stop_iteration"] is True
    assert plugin["failure_policy"] == "FAIL_OPEN"
    assert plugin["root_id"] == "llm_governor"
    remote = plugin["vm_config"]["code"]["remote"]
    assert remote["http_uri"]["uri"].startswith("oci://")
    result = envoy_validate({"name": ecds["name"], "typed_config": local_code(typed)}, tmp_path)
    assert_accepted(result, "the EnvoyFilter's Wasm config")
    # The HTTP filter patch takes its config from this extension config, before the router.
    patches = one("istio/EnvoyFilter")["spec"]["configPatches"]
    http = [p for p in patches if p["applyTo"] == "HTTP_FILTER"][0]
    assert http["patch"]["operation"] == "INSERT_BEFORE"
    assert http["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == "envoy.filters.http.router"
    assert http["patch"]["value"]["name"] == ecds["name"]
    assert http["patch"]["value"]["config_discovery"]["type_urls"] == [typed["@type"]]


# --- the EnvoyPatchPolicy, applied to a listener as Envoy Gateway generates it ---------------


def eg_wasm_filter() -> dict:
    """The Wasm filter EG 1.8/1.9 generates for the policy (EG's internal/xds/translator/wasm.go):
    named after the policy, its VM named the same, fail_open from `failOpen`, the config as a
    JSON string, and no allow_on_headers_stop_iteration."""
    wasm = one(EG_POLICY)["spec"]["wasm"][0]
    return {
        "name": EG_WASM_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": wasm["name"],
                "root_id": wasm["rootID"],
                "vm_config": {
                    "vm_id": EG_WASM_FILTER.split("/", 1)[1],
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": str(WASM_MODULE)}},
                    "environment_variables": {"host_env_keys": wasm["env"]["hostKeys"]},
                },
                "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                                  "value": json.dumps(wasm["config"])},
                "fail_open": wasm["failOpen"],
            },
        },
    }


def eg_listener(hcm_filter: dict) -> dict:
    """A listener in the shape EG generates for a policy's filter: disabled on the HCM, before
    the router, and enabled on the route by an empty FilterConfig."""
    hcm_filter = {**hcm_filter, "disabled": True}
    boot = envoy_bootstrap(upstream_port=9, http_filters=[])
    listener = boot["static_resources"]["listeners"][0]
    listener["name"] = "llm-gateway/llm-gateway/http"
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"].insert(0, hcm_filter)
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]
    route["typed_per_filter_config"] = {
        hcm_filter["name"]: {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}
    }
    # EG puts an HTTP listener's chain in default_filter_chain: so does this one.
    listener["default_filter_chain"] = listener.pop("filter_chains")[0]
    return boot


JSONPATH = re.compile(r"^\.\.(\w+)\[\?@\.name\s*==\s*'([^']+)'\]((?:\.\w+)*)$")


def json_pointers(document, expression: str) -> list:
    """JSON pointers for the one JSONPath shape the patch uses: ..key[?@.name=='v'].a.b
    (RFC 9535). Any other expression fails the test rather than being half-understood."""
    match = JSONPATH.match(expression)
    assert match, f"jsonPath {expression!r} is not of the shape this test evaluates"
    key, name, tail = match.group(1), match.group(2), [p for p in match.group(3).split(".") if p]
    found = []

    def walk(node, pointer):
        if isinstance(node, dict):
            for k, v in node.items():
                here = f"{pointer}/{k}"
                if k == key and isinstance(v, list):
                    for i, item in enumerate(v):
                        if isinstance(item, dict) and item.get("name") == name:
                            target, ptr = item, f"{here}/{i}"
                            for part in tail:
                                if not isinstance(target, dict) or part not in target:
                                    break
                                target, ptr = target[part], f"{ptr}/{part}"
                            else:
                                found.append(ptr)
                walk(v, here)
        elif isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{pointer}/{i}")

    walk(document, "")
    return found


def apply_add(document, pointer: str, value) -> None:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]
    target = document
    for part in parts[:-1]:
        target = target[int(part)] if isinstance(target, list) else target[part]
    target[parts[-1]] = value


def test_the_envoypatchpolicy_sets_stop_iteration_on_eg_s_wasm_filter(tmp_path):
    policy = one("envoy-gateway/EnvoyPatchPolicy")
    assert policy["spec"]["type"] == "JSONPatch"
    assert policy["spec"]["targetRef"] == one(EG_POLICY)["spec"]["targetRefs"][0]
    boot = eg_listener(eg_wasm_filter())
    listener = boot["static_resources"]["listeners"][0]
    patches = policy["spec"]["jsonPatches"]
    assert [p["type"] for p in patches] == ["type.googleapis.com/envoy.config.listener.v3.Listener"]
    for patch in patches:
        assert patch["name"] == listener["name"]
        op = patch["operation"]
        assert op["op"] == "add"
        pointers = json_pointers(listener, op["jsonPath"])
        assert len(pointers) == 1, f"jsonPath selects {pointers}"
        apply_add(listener, pointers[0] + "/" + op["path"], op["value"])
    plugin = listener["default_filter_chain"]["filters"][0]["typed_config"]["http_filters"][0]["typed_config"]["config"]
    assert plugin["allow_on_headers_stop_iteration"] is True
    assert_accepted(envoy_validate({}, tmp_path, bootstrap=boot), "EG's listener with the patch applied")


def test_the_eg_shaped_listener_really_loads_the_module(tmp_path):
    # The control for the test above: the same listener with a config the module refuses fails
    # validation, so a pass there means on_configure ran on the patched filter.
    boot = eg_listener(eg_wasm_filter())
    hcm = boot["static_resources"]["listeners"][0]["default_filter_chain"]["filters"][0]["typed_config"]
    hcm["http_filters"][0]["typed_config"]["config"]["configuration"]["value"] = '{"max_keys": 0}'
    result = envoy_validate({}, tmp_path, bootstrap=boot)
    assert result.returncode != 0 and "max_keys" in result.stdout + result.stderr, (result.stdout + result.stderr)[-2000:]


# --- the native build on Envoy Gateway: deploy/envoy-gateway-native/ --------------------------


def native_policy_filter() -> dict:
    return one(NATIVE_POLICY)["spec"]["dynamicModule"][0]


def registered_module(policy_filter: dict) -> dict:
    """The EnvoyProxy's dynamicModules entry the policy's filter names (EG refuses a policy
    naming a module its Gateway's EnvoyProxy does not register)."""
    entries = [e for e in one(NATIVE_PROXY)["spec"]["dynamicModules"] if e["name"] == policy_filter["name"]]
    assert len(entries) == 1, f"the policy's module {policy_filter['name']!r} is not registered in the EnvoyProxy"
    return entries[0]


def native_yaml_filter() -> dict:
    """The dynamic-module filter of envoy/native.yaml, the plain-Envoy config of the same module."""
    native = yaml.safe_load((REPO_ROOT / "envoy" / "native.yaml").read_text())
    hcm = native["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    found = [f["typed_config"] for f in hcm["http_filters"] if f["typed_config"]["@type"] == DYNAMIC_MODULE_FILTER]
    assert len(found) == 1, hcm["http_filters"]
    return found[0]


def eg_native_filter(module: Path) -> dict:
    """The dynamic-module filter EG generates for the policy (EG's
    internal/xds/translator/dynamicmodule.go): named after the policy, the module by absolute
    path (`module.local.filename`, no `name`: no search path), do_not_close and load_globally
    from the EnvoyProxy's entry, the config as a JSON string. `module` stands in for the path
    on the proxy, as local_code() does for the wasm image."""
    policy_filter = native_policy_filter()
    entry = registered_module(policy_filter)
    return {
        "name": EG_NATIVE_FILTER,
        "typed_config": {
            "@type": DYNAMIC_MODULE_FILTER,
            "dynamic_module_config": {
                "do_not_close": entry.get("doNotClose", False),
                "load_globally": entry.get("loadGlobally", False),
                "module": {"local": {"filename": str(module)}},
            },
            "filter_name": policy_filter.get("filterName", ""),
            "terminal_filter": policy_filter.get("terminalFilter", False),
            "filter_config": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                              "value": json.dumps(policy_filter["config"])},
        },
    }


def native_module() -> Path:
    assert NATIVE_MODULE.is_file(), f"{NATIVE_MODULE} missing: run make build-native (or set LLM_GOVERNOR_NATIVE)"
    return NATIVE_MODULE


def test_the_native_manifests_name_the_module_as_envoy_native_yaml_does():
    native = native_yaml_filter()
    policy_filter = native_policy_filter()
    entry = registered_module(policy_filter)
    # Envoy's search path finds `name` as lib<name>.so: the file EG loads is that file.
    path = entry["source"]["local"]["path"]
    assert entry["source"]["type"] == "Local"
    assert path.startswith("/"), f"source.local.path {path!r} must be absolute (EG passes it to Envoy as a filename)"
    assert Path(path).name == f"lib{native['dynamic_module_config']['name']}.so", (path, native)
    assert policy_filter["filterName"] == native["filter_name"]
    # The module runs a timer thread: never unloaded, on plain Envoy and on EG (whose default is false).
    assert native["dynamic_module_config"]["do_not_close"] is True
    assert entry["doNotClose"] is True
    assert not entry.get("loadGlobally", False)
    assert not policy_filter.get("terminalFilter", False)


def test_the_native_manifests_replace_the_wasm_ones_on_the_same_gateway():
    # Same objects as deploy/envoy-gateway/ (applying one folder after the other switches the
    # build), on the Gateway of deploy/envoy-gateway/gateway.yaml, with the same hash key.
    for wasm, native in ((EG_POLICY, NATIVE_POLICY), (EG_PROXY, NATIVE_PROXY)):
        assert one(native)["metadata"] == one(wasm)["metadata"], (wasm, native)
    assert one(NATIVE_POLICY)["spec"]["targetRefs"] == one(EG_POLICY)["spec"]["targetRefs"]
    gateway = one("envoy-gateway/Gateway")
    target = one(NATIVE_POLICY)["spec"]["targetRefs"][0]
    assert (target["kind"], target["name"]) == ("Gateway", gateway["metadata"]["name"])
    parameters = gateway["spec"]["infrastructure"]["parametersRef"]
    assert parameters["name"] == one(NATIVE_PROXY)["metadata"]["name"]
    assert one(NATIVE_PROXY)["metadata"]["namespace"] == gateway["metadata"]["namespace"]
    container = one(NATIVE_PROXY)["spec"]["provider"]["kubernetes"]["envoyDeployment"]["container"]
    wasm_container = one(EG_PROXY)["spec"]["provider"]["kubernetes"]["envoyDeployment"]["container"]
    assert container["env"] == wasm_container["env"]
    # No EnvoyPatchPolicy and no stats tags: the native module needs neither.
    assert {doc["kind"] for path, doc in all_objects() if path.parent == NATIVE_DIR} == {"EnvoyProxy", "EnvoyExtensionPolicy"}
    assert "bootstrap" not in one(NATIVE_PROXY)["spec"]


def test_the_proxy_image_carries_the_module_where_the_envoyproxy_loads_it():
    dockerfile = (NATIVE_DIR / "Dockerfile").read_text()
    instructions = [line.split(None, 1) for line in dockerfile.splitlines() if line.strip() and not line.startswith("#")]
    froms = [rest for op, rest in instructions if op == "FROM"]
    copies = [rest.split() for op, rest in instructions if op == "COPY"]
    # The Envoy the project tests on (envoy/docker-compose.yaml's image): the module's ABI.
    compose = yaml.safe_load((REPO_ROOT / "envoy" / "docker-compose.yaml").read_text())
    assert froms == [compose["services"]["envoy"]["image"]]
    assert copies == [["target/release/libllm_governor.so", registered_module(native_policy_filter())["source"]["local"]["path"]]]
    # The EnvoyProxy runs that image, tagged with the crate's version as the wasm image is.
    container = one(NATIVE_PROXY)["spec"]["provider"]["kubernetes"]["envoyDeployment"]["container"]
    assert container["image"].rsplit(":", 1)[1] == oci_image.crate_version()
    assert container["image"] in dockerfile, "the Dockerfile's build command tags another image than the EnvoyProxy runs"


def test_eg_s_filter_for_the_native_policy_loads_the_module_by_its_path(tmp_path):
    # As EG generates it, with the README's example configuration: Envoy dlopens the .so from
    # the absolute path (ENVOY_DYNAMIC_MODULES_SEARCH_PATH unset) and config_new accepts it.
    boot = eg_listener(eg_native_filter(native_module()))
    assert_accepted(envoy_validate({}, tmp_path, bootstrap=boot), "EG's listener with the native module")


def test_eg_s_filter_for_the_native_policy_really_configures_the_module(tmp_path):
    # The control for the test above: a config the module refuses fails, naming the field, so
    # a pass there means the native module's config_new ran on the policy's config.
    filter_ = eg_native_filter(native_module())
    config = copy.deepcopy(native_policy_filter()["config"])
    config["limits"][0]["requests_per_minute"] = 0
    filter_["typed_config"]["filter_config"]["value"] = json.dumps(config)
    result = envoy_validate({}, tmp_path, bootstrap=eg_listener(filter_))
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "limits[0].requests_per_minute" in output, output[-2000:]
    # And a path with no module there is refused: the path is what Envoy loads.
    filter_ = eg_native_filter(tmp_path / "libllm_governor.so")
    result = envoy_validate({}, tmp_path, bootstrap=eg_listener(filter_))
    assert result.returncode != 0, (result.stdout + result.stderr)[-2000:]


# --- stats tags: the labels the dashboard's queries group by --------------------------------


def test_istio_and_eg_bootstraps_tag_the_pool_as_the_shipped_configs_do(tmp_path):
    configmap = one("istio/ConfigMap")
    istio_bootstrap = json.loads(configmap["data"]["custom_bootstrap.json"])
    assert istio_bootstrap["stats_config"]["stats_tags"] == STATS_TAGS
    gateways = [doc for _, doc in all_objects() if doc["kind"] == "Gateway"]
    istio_gw = [g for g in gateways if g["spec"]["gatewayClassName"] == "istio"][0]
    annotations = istio_gw["spec"]["infrastructure"]["annotations"]
    assert annotations["sidecar.istio.io/bootstrapOverride"] == configmap["metadata"]["name"]
    proxy_config = yaml.safe_load(annotations["proxy.istio.io/config"])
    assert "wasmcustom.llm_governor" in proxy_config["proxyStatsMatcher"]["inclusionPrefixes"]

    envoyproxy = one(EG_PROXY)
    assert envoyproxy["spec"]["bootstrap"]["type"] == "Merge"
    eg_bootstrap = yaml.safe_load(envoyproxy["spec"]["bootstrap"]["value"])
    assert eg_bootstrap["stats_config"]["stats_tags"] == STATS_TAGS
    eg_gw = [g for g in gateways if g["spec"]["gatewayClassName"] != "istio"][0]
    ref = eg_gw["spec"]["infrastructure"]["parametersRef"]
    assert (ref["group"], ref["kind"], ref["name"]) == ("gateway.envoyproxy.io", "EnvoyProxy", envoyproxy["metadata"]["name"])

    # Both merged into a bootstrap with the module: Envoy takes them.
    for merged in (istio_bootstrap, eg_bootstrap):
        boot = envoy_bootstrap(upstream_port=9, http_filters=[wasm_filter("{}")])
        boot["stats_config"] = merged["stats_config"]
        assert_accepted(envoy_validate({}, tmp_path, bootstrap=boot), "the stats tags merge")


# --- the pin ---------------------------------------------------------------------------------


def test_every_manifest_pins_the_image_of_the_module_under_test():
    digest = oci_image.manifest_digest(WASM_MODULE.read_bytes()).split(":", 1)[1]
    version = oci_image.crate_version()
    for path in oci_image.PINNED_MANIFESTS:
        pins = oci_image.pinned_digests(path)
        assert pins, f"{path.relative_to(REPO_ROOT)} pins no digest"
        assert set(pins) == {digest}, (
            f"{path.relative_to(REPO_ROOT)} pins {sorted(set(pins))}, but the module under test "
            f"gives the image sha256:{digest}: run `make image` (it rewrites the pin) and commit deploy/"
        )
        tags = re.findall(r"llm-governor:([A-Za-z0-9._-]+)", path.read_text())
        assert tags and set(tags) == {version}, f"{path.relative_to(REPO_ROOT)}: image tag {tags} is not {version}"
    # And the two places that name the digest are the manifests the image script rewrites.
    assert one(ISTIO_PLUGIN)["spec"]["sha256"] == digest
    assert one(EG_POLICY)["spec"]["wasm"][0]["code"]["image"]["sha256"] == digest
    assert envoyfilter_wasm()["typed_config"]["config"]["vm_config"]["code"]["remote"]["sha256"] == digest


def test_make_image_rewrites_a_stale_pin(tmp_path):
    stale = tmp_path / "wasmplugin.yaml"
    stale.write_text((DEPLOY / "istio" / "wasmplugin.yaml").read_text().replace(
        one(ISTIO_PLUGIN)["spec"]["sha256"], "f" * 64))
    digest = oci_image.manifest_digest(WASM_MODULE.read_bytes())
    assert oci_image.rewrite_manifests(digest, [stale]) == [stale]
    assert yaml.safe_load(stale.read_text())["spec"]["sha256"] == digest.split(":", 1)[1]
    assert oci_image.rewrite_manifests(digest, [stale]) == []  # already pinned: untouched
