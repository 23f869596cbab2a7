"""Envoy configuration as the shipped configs write it: the filter entry of each artifact, a
static bootstrap (one listener to the `provider` cluster), and the failover bootstrap with a
`backup` cluster routed on `x-llm-governor-pool`."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Optional, Union

from artifacts import WASM_MODULE, artifact_of
from stats import STATS_TAGS


# The prediction errors (issue 32) are percentages: buckets fine enough to read a median of a
# few percent (Envoy's defaults jump from 5 to 10 to 25). README "Stats" shows the same.
HISTOGRAM_BUCKETS = [{
    "match": {"safe_regex": {"regex": ".*prediction_error_pct.*"}},
    "buckets": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 15, 20, 25, 30, 40, 50, 75, 100, 200, 500, 1000],
}]


def wasm_filter(
    plugin_config: Union[dict, str],
    module: Union[str, Path] = WASM_MODULE,
    allow_on_headers_stop_iteration: bool = True,
    failure_policy: str = "FAIL_OPEN",
    name: str = "llm_governor",
    host_env_keys: Optional[list] = None,
) -> dict:
    """The envoy.filters.http.wasm entry exactly as the shipped configs declare it (name: the
    plugin name, root id and vm id; the benchmarks load the empty module under its own)."""
    value = plugin_config if isinstance(plugin_config, str) else json.dumps(plugin_config)
    return {
        "name": "envoy.filters.http.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": name,
                "root_id": name,
                "failure_policy": failure_policy,
                "allow_on_headers_stop_iteration": allow_on_headers_stop_iteration,
                "vm_config": {
                    "vm_id": name,
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": str(module)}},
                    # Environment variables the VM may read (LLM_GOVERNOR_HASH_KEY).
                    **({"environment_variables": {"host_env_keys": host_env_keys}} if host_env_keys else {}),
                },
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": value,
                },
            },
        },
    }


def native_filter(plugin_config: Union[dict, str], name: str = "llm_governor") -> dict:
    """The dynamic-module filter entry exactly as the contract declares it: the module is found
    by name in $ENVOY_DYNAMIC_MODULES_SEARCH_PATH (the harness sets it for every Envoy)."""
    value = plugin_config if isinstance(plugin_config, str) else json.dumps(plugin_config)
    return {
        "name": name,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            "dynamic_module_config": {"name": name, "do_not_close": True},
            "filter_name": name,
            "filter_config": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": value},
        },
    }


def governor_filter(plugin_config: Union[dict, str], artifact: Optional[str] = None, **wasm_args: Any) -> dict:
    """The filter entry of the artifact under test, or of `artifact` (wasm_args: `wasm_filter`'s,
    which a dynamic module has no equivalent of: it never rewrites a pause, and cannot fail open
    or closed)."""
    if artifact_of(artifact) == "native":
        return native_filter(plugin_config)
    return wasm_filter(plugin_config, **wasm_args)


def envoy_bootstrap(
    upstream_port: int,
    http_filters: list,
    listener_port: int = 0,
    admin_port: int = 0,
    route_timeout: str = "300s",
    access_log_path: Optional[str] = None,
    access_log_format: Union[dict, str, None] = None,
    stats_flush_interval: Optional[str] = None,
    extra_clusters: Optional[list] = None,
) -> dict:
    """A static bootstrap: one listener -> cluster `provider` on 127.0.0.1:upstream_port
    (plus extra_clusters, e.g. the fleet's rate-limit service).

    With access_log_path, the connection manager writes an `envoy.access_loggers.file` log
    there: access_log_format a dict gives JSON lines (`json_format`), a string a text format.
    stats_flush_interval (e.g. "1s") shortens Envoy's default 5 s flush, after which histograms
    show in /stats/prometheus.
    """
    loopback = lambda port: {"socket_address": {"address": "127.0.0.1", "port_value": port}}  # noqa: E731
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
    }
    hcm_extra: dict = {}
    if access_log_path:
        log_format: dict = {}
        if isinstance(access_log_format, dict):
            log_format = {"json_format": access_log_format}
        elif access_log_format:
            log_format = {"text_format_source": {"inline_string": access_log_format}}
        hcm_extra["access_log"] = [
            {
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                    "path": str(access_log_path),
                    **({"log_format": log_format} if log_format else {}),
                },
            }
        ]
    bootstrap_extra: dict = {}
    if stats_flush_interval:
        bootstrap_extra["stats_flush_interval"] = stats_flush_interval
    return {
        **bootstrap_extra,
        "admin": {"address": loopback(admin_port)},
        "stats_config": {"stats_tags": STATS_TAGS, "histogram_bucket_settings": HISTOGRAM_BUCKETS},
        "static_resources": {
            "listeners": [
                {
                    "name": "llm_gateway",
                    "address": loopback(listener_port),
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.network"
                                        ".http_connection_manager.v3.HttpConnectionManager",
                                        "stat_prefix": "llm_gateway",
                                        "route_config": {
                                            "virtual_hosts": [
                                                {
                                                    "name": "providers",
                                                    "domains": ["*"],
                                                    "routes": [
                                                        {
                                                            "match": {"prefix": "/"},
                                                            "route": {
                                                                "cluster": "provider",
                                                                "timeout": route_timeout,
                                                            },
                                                        }
                                                    ],
                                                }
                                            ]
                                        },
                                        "http_filters": list(http_filters) + [router],
                                        **hcm_extra,
                                    },
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "provider",
                    "type": "STATIC",
                    "connect_timeout": "2s",
                    "load_assignment": {
                        "cluster_name": "provider",
                        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": loopback(upstream_port)}}]}],
                    },
                }
            ]
            + list(extra_clusters or []),
        },
    }


def failover_bootstrap(
    primary_port: int,
    backup_port: int,
    plugin_config: dict,
    backup_pools: tuple = ("openai-backup",),
    backup_key: str = "sk-backup-injected",
    artifact: Optional[str] = None,
) -> dict:
    """envoy_bootstrap with llm-governor plus a `backup` cluster on backup_port, routed on
    `x-llm-governor-pool: <pool>` for each of backup_pools, with the backup's credential
    injected (as `x-api-key`) and the client's own credential headers removed, as
    envoy/failover.yaml does."""
    boot = envoy_bootstrap(primary_port, [governor_filter(plugin_config, artifact=artifact)])
    clusters = boot["static_resources"]["clusters"]
    backup = copy.deepcopy(clusters[0])
    backup["name"] = backup["load_assignment"]["cluster_name"] = "backup"
    backup["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
        "port_value"
    ] = backup_port
    clusters.append(backup)
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    for pool in backup_pools:
        routes.insert(0, {
            "match": {"prefix": "/", "headers": [{"name": "x-llm-governor-pool", "string_match": {"exact": pool}}]},
            "route": {"cluster": "backup", "timeout": "300s"},
            "request_headers_to_remove": ["x-api-key", "api-key", "authorization", "x-llm-governor-pool"],
            "request_headers_to_add": [
                {"header": {"key": "x-api-key", "value": backup_key}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            ],
        })
    return boot
