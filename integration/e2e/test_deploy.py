"""The Kubernetes manifests in deploy/: valid for the real CRDs, carrying a configuration the
module accepts, pinned to the image of the module under test.

- WasmPlugin, EnvoyExtensionPolicy and EnvoyProxy against the CRD schemas in ../shared/crds
  (openAPIV3Schema with strict fields, list types, and every CEL rule on a node the manifest
  has: integration/e2e/crd_check.py). A control per kind of drift shows the check can fail.
- The filter configuration each manifest embeds is loaded by the module itself, the way
  `make validate` loads the shipped configs: `envoy --mode validate` on a bootstrap carrying it,
  which runs on_configure. The EnvoyFilter's whole Wasm config and the EnvoyPatchPolicy's
  result (applied to a listener shaped as Envoy Gateway generates it) go through Envoy too.
- The `sha256` every manifest pins is the digest `make image` gives the module under test,
  and the plugin configuration is the README's example, the same in every manifest.

EnvoyFilter, EnvoyPatchPolicy, Gateway and ConfigMap have no CRD schema here (not in
../shared/crds): they are checked through Envoy as above, and their fields by the tests below.
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
from harness import REPO_ROOT, STATS_TAGS, WASM_MODULE, envoy_bootstrap, find_envoy, wasm_filter, wasm_only

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import oci_image  # noqa: E402

# The image and the manifests carry the wasm module: checked once, in the wasm pass.
pytestmark = wasm_only("the image and the manifests carry the wasm module")

DEPLOY = REPO_ROOT / "deploy"
CRD_DIR = Path(os.environ.get("LLM_GOVERNOR_CRDS") or REPO_ROOT.parent / "shared" / "crds")
SCHEMA_CHECKED = ("WasmPlugin", "EnvoyExtensionPolicy", "EnvoyProxy")
EG_WASM_FILTER = "envoy.filters.http.wasm/envoyextensionpolicy/llm-gateway/llm-governor/wasm/0"


def documents(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_objects() -> list:
    out = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for doc in documents(path):
            out.append((path, doc))
    return out


def one(kind: str) -> dict:
    found = [doc for _, doc in all_objects() if doc.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def crds() -> dict:
    if not CRD_DIR.is_dir():
        message = f"CRD schemas not found at {CRD_DIR} (the shared/crds folder beside the repository; or set LLM_GOVERNOR_CRDS)"
        if os.environ.get("CI") == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    loaded = crd_check.load_crds(CRD_DIR)
    assert {kind for _, kind in loaded} >= set(SCHEMA_CHECKED), loaded.keys()
    return loaded


def readme_example_config() -> dict:
    text = (REPO_ROOT / "README.md").read_text()
    section = text.split("\n## Configuration\n", 1)[1]
    block = re.search(r"```json\n(.*?)\n```", section, re.S)
    assert block, "README's Configuration section has no ```json example"
    return json.loads(block.group(1))


def envoy_validate(http_filter: dict, tmp_path: Path, bootstrap: dict = None) -> subprocess.CompletedProcess:
    """`envoy --mode validate` on a bootstrap with http_filter before the router, as
    scripts/validate.sh runs it: the module is loaded and its on_configure runs."""
    boot = bootstrap or envoy_bootstrap(upstream_port=9, http_filters=[http_filter])
    path = tmp_path / f"validate-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(boot))
    return subprocess.run(
        [find_envoy(), "--mode", "validate", "--config-path", str(path), "--disable-hot-restart", "--log-level", "warn"],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
    )


def assert_accepted(result: subprocess.CompletedProcess, what: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"envoy --mode validate refused {what}:\n{output[-3000:]}"
    assert "invalid configuration" not in output, output[-3000:]
    assert not [l for l in output.splitlines() if "[critical]" in l], output[-3000:]


# --- the manifests against the CRDs ----------------------------------------------------------


def test_every_manifest_in_deploy_is_a_known_kind():
    kinds = sorted(doc["kind"] for _, doc in all_objects())
    assert kinds == sorted(["WasmPlugin", "EnvoyFilter", "ConfigMap", "Gateway", "Gateway",
                            "EnvoyExtensionPolicy", "EnvoyProxy", "EnvoyPatchPolicy"]), kinds


@pytest.mark.parametrize("kind", SCHEMA_CHECKED)
def test_manifest_is_valid_for_its_crd(kind, crds):
    report = crd_check.check(one(kind), crds)
    assert report.ok, "\n".join(report.errors)
    assert report.rules_evaluated, f"no CEL rule of {kind}'s CRD was evaluated"
    assert not report.rules_skipped, report.rules_skipped


def test_the_cel_rules_that_apply_are_evaluated(crds):
    # Which rules each manifest is checked against (the README's Deploy section lists them).
    covered = {kind: {msg for _, msg in crd_check.check(one(kind), crds).rules_evaluated} for kind in SCHEMA_CHECKED}
    assert covered["WasmPlugin"] >= {
        "only one of targetRefs or selector can be set",
        "url must have schema one of [http, https, file, oci]",
        "value may only be set when valueFrom is INLINE",
    }
    assert covered["EnvoyExtensionPolicy"] >= {
        "either targetRef or targetRefs must be used",
        "this policy can only have a targetRefs[*].group of gateway.networking.k8s.io",
        "If type is Image, image field needs to be set.",
        "If type is HTTP, http field needs to be set.",
    }
    assert "Either image or imageRepository can be set." in covered["EnvoyProxy"]


def drifted(kind: str, edit) -> dict:
    doc = copy.deepcopy(one(kind))
    edit(doc)
    return doc


DRIFTS = [
    ("WasmPlugin", "unknown field", lambda d: d["spec"].update(failStratgy="FAIL_OPEN"), "'failStratgy' was unexpected"),
    ("WasmPlugin", "enum", lambda d: d["spec"].update(failStrategy="FAIL_SOMETIMES"), "is not one of"),
    ("WasmPlugin", "pattern", lambda d: d["spec"].update(sha256="sha256:" + "0" * 64), "does not match"),
    ("WasmPlugin", "CEL: selector and targetRefs",
     lambda d: d["spec"].update(selector={"matchLabels": {"istio": "ingressgateway"}}),
     "only one of targetRefs or selector can be set"),
    ("WasmPlugin", "CEL: url scheme", lambda d: d["spec"].update(url="ftp://registry.example.com/llm-governor"),
     "url must have schema one of"),
    ("WasmPlugin", "CEL: HOST env with a value", lambda d: d["spec"]["vmConfig"]["env"][0].update(value="secret"),
     "value may only be set when valueFrom is INLINE"),
    ("EnvoyExtensionPolicy", "unknown field", lambda d: d["spec"]["wasm"][0].update(failopen=True), "'failopen' was unexpected"),
    ("EnvoyExtensionPolicy", "type", lambda d: d["spec"]["wasm"][0].update(failOpen="yes"), "is not of type 'boolean'"),
    ("EnvoyExtensionPolicy", "CEL: Image without image",
     lambda d: d["spec"]["wasm"][0]["code"].update(type="HTTP"), "If type is HTTP, http field needs to be set."),
    ("EnvoyExtensionPolicy", "CEL: targetRefs group",
     lambda d: d["spec"]["targetRefs"][0].update(group="networking.istio.io"), "targetRefs[*].group of gateway.networking.k8s.io"),
    ("EnvoyExtensionPolicy", "CEL: no target", lambda d: d["spec"].pop("targetRefs"), "either targetRef or targetRefs must be used"),
    ("EnvoyProxy", "enum", lambda d: d["spec"]["bootstrap"].update(type="Overwrite"), "is not one of"),
    ("EnvoyProxy", "CEL: image and imageRepository",
     lambda d: d["spec"]["provider"]["kubernetes"]["envoyDeployment"]["container"].update(
         image="envoyproxy/envoy:v1.40-latest", imageRepository="envoyproxy/envoy"),
     "Either image or imageRepository can be set."),
]


@pytest.mark.parametrize("kind,what,edit,expected", DRIFTS, ids=[f"{k}: {w}" for k, w, _, _ in DRIFTS])
def test_a_drifted_manifest_is_refused(kind, what, edit, expected, crds):
    report = crd_check.check(drifted(kind, edit), crds)
    assert not report.ok, f"{kind} with a {what} drift passed"
    assert any(expected in e for e in report.errors), report.errors


def test_crd_defaults_are_applied_before_the_rules(crds):
    # pullSecretRef.kind defaults to Secret, and its CEL rule reads it: a manifest that names
    # only the Secret's name passes, as the API server would accept it.
    doc = drifted("EnvoyExtensionPolicy", lambda d: d["spec"]["wasm"][0]["code"]["image"].update(
        pullSecretRef={"name": "registry-credentials"}))
    assert crd_check.check(doc, crds).ok
    doc["spec"]["wasm"][0]["code"]["image"]["pullSecretRef"]["kind"] = "ConfigMap"
    assert "only support Secret kind." in " ".join(crd_check.check(doc, crds).errors)


# --- the configuration the module gets ------------------------------------------------------


def istio_plugin_config() -> dict:
    return one("WasmPlugin")["spec"]["pluginConfig"]


def eg_plugin_config() -> dict:
    return one("EnvoyExtensionPolicy")["spec"]["wasm"][0]["config"]


def envoyfilter_wasm() -> dict:
    patches = one("EnvoyFilter")["spec"]["configPatches"]
    ecds = [p for p in patches if p["applyTo"] == "EXTENSION_CONFIG"]
    assert len(ecds) == 1, patches
    return ecds[0]["patch"]["value"]


def test_every_manifest_carries_the_readme_example_config():
    example = readme_example_config()
    assert istio_plugin_config() == example
    assert eg_plugin_config() == example
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
    patches = one("EnvoyFilter")["spec"]["configPatches"]
    http = [p for p in patches if p["applyTo"] == "HTTP_FILTER"][0]
    assert http["patch"]["operation"] == "INSERT_BEFORE"
    assert http["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == "envoy.filters.http.router"
    assert http["patch"]["value"]["name"] == ecds["name"]
    assert http["patch"]["value"]["config_discovery"]["type_urls"] == [typed["@type"]]


# --- the EnvoyPatchPolicy, applied to a listener as Envoy Gateway generates it ---------------


def eg_listener() -> dict:
    """A listener in the shape EG 1.8/1.9 generates for the policy (EG's
    internal/xds/translator/wasm.go): the Wasm filter named after the policy, disabled on the
    HCM and enabled per route, its VM named the same, fail_open from `failOpen`, the config as
    a JSON string, and no allow_on_headers_stop_iteration."""
    wasm = one("EnvoyExtensionPolicy")["spec"]["wasm"][0]
    hcm_filter = {
        "name": EG_WASM_FILTER,
        "disabled": True,
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
    boot = envoy_bootstrap(upstream_port=9, http_filters=[])
    listener = boot["static_resources"]["listeners"][0]
    listener["name"] = "llm-gateway/llm-gateway/http"
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"].insert(0, hcm_filter)
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]
    route["typed_per_filter_config"] = {
        EG_WASM_FILTER: {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}
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
    policy = one("EnvoyPatchPolicy")
    assert policy["spec"]["type"] == "JSONPatch"
    assert policy["spec"]["targetRef"] == one("EnvoyExtensionPolicy")["spec"]["targetRefs"][0]
    boot = eg_listener()
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
    boot = eg_listener()
    hcm = boot["static_resources"]["listeners"][0]["default_filter_chain"]["filters"][0]["typed_config"]
    hcm["http_filters"][0]["typed_config"]["config"]["configuration"]["value"] = '{"max_keys": 0}'
    result = envoy_validate({}, tmp_path, bootstrap=boot)
    assert result.returncode != 0 and "max_keys" in result.stdout + result.stderr, (result.stdout + result.stderr)[-2000:]


# --- stats tags: the labels the dashboard's queries group by --------------------------------


def test_istio_and_eg_bootstraps_tag_the_pool_as_the_shipped_configs_do(tmp_path):
    configmap = one("ConfigMap")
    istio_bootstrap = json.loads(configmap["data"]["custom_bootstrap.json"])
    assert istio_bootstrap["stats_config"]["stats_tags"] == STATS_TAGS
    gateways = [doc for _, doc in all_objects() if doc["kind"] == "Gateway"]
    istio_gw = [g for g in gateways if g["spec"]["gatewayClassName"] == "istio"][0]
    annotations = istio_gw["spec"]["infrastructure"]["annotations"]
    assert annotations["sidecar.istio.io/bootstrapOverride"] == configmap["metadata"]["name"]
    proxy_config = yaml.safe_load(annotations["proxy.istio.io/config"])
    assert "wasmcustom.llm_governor" in proxy_config["proxyStatsMatcher"]["inclusionPrefixes"]

    envoyproxy = one("EnvoyProxy")
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
    assert one("WasmPlugin")["spec"]["sha256"] == digest
    assert one("EnvoyExtensionPolicy")["spec"]["wasm"][0]["code"]["image"]["sha256"] == digest
    assert envoyfilter_wasm()["typed_config"]["config"]["vm_config"]["code"]["remote"]["sha256"] == digest


def test_make_image_rewrites_a_stale_pin(tmp_path):
    stale = tmp_path / "wasmplugin.yaml"
    stale.write_text((DEPLOY / "istio" / "wasmplugin.yaml").read_text().replace(
        one("WasmPlugin")["spec"]["sha256"], "f" * 64))
    digest = oci_image.manifest_digest(WASM_MODULE.read_bytes())
    assert oci_image.rewrite_manifests(digest, [stale]) == [stale]
    assert yaml.safe_load(stale.read_text())["spec"]["sha256"] == digest.split(":", 1)[1]
    assert oci_image.rewrite_manifests(digest, [stale]) == []  # already pinned: untouched
