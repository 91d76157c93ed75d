"""The Grafana dashboard and its provisioning files, checked without Grafana (no Grafana runs on these
machines): the dashboard is read with Grafana's own Python SDK (``grafana-foundation-sdk``, its models of
Grafana 11.6's dashboard schema and panel plugins) and must come back with every field it sets, unchanged;
its structure (ids, grid, data source, queries, variables) and the provisioning files must fit together and
fit ``compose.yaml``. tests/integration/test_dashboard.py runs every panel's query against Prometheus.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Mapping
from typing import Any, Final

import orjson
import pytest
from grafana_foundation_sdk.cog import runtime
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models import dashboard as grafana

from tests.support.env import IN_CI
from tests.support.monitoring import (
    COMPOSE_FILE,
    DASHBOARD,
    DASHBOARD_PROVIDERS,
    DASHBOARDS,
    DATASOURCES,
    GRAFANA,
    PROMETHEUS_CONFIG,
    REPO,
    all_panels,
    fill_in,
    load_dashboard,
    load_yaml,
    metric_names,
    panel_queries,
    variable_query,
    variables,
    variables_used,
)

GRID_COLUMNS: Final = 24

register_default_plugins()


def round_trip_losses(data: Any, back: Any, path: str = "") -> list[str]:
    """Where ``back`` (the dashboard after Grafana's model) lost or changed what ``data`` set."""
    if isinstance(data, dict):
        if not isinstance(back, dict):
            return [f"{path}: became {back!r}"]
        out = []
        for key, value in data.items():
            if key not in back:
                out.append(f"{path}.{key}: not a field Grafana knows here")
            else:
                out += round_trip_losses(value, back[key], f"{path}.{key}")
        return out
    if isinstance(data, list):
        if not isinstance(back, list) or len(back) != len(data):
            return [f"{path}: became {back!r}"]
        return [
            loss
            for i, (a, b) in enumerate(zip(data, back, strict=True))
            for loss in round_trip_losses(a, b, f"{path}[{i}]")
        ]
    return [] if data == back else [f"{path}: {data!r} became {back!r}"]


def property_known(panel_type: str, prop: Mapping[str, Any]) -> bool:
    """An override's property id is a field config field: ``custom.X`` of the panel plugin, else Grafana's."""
    pid, value = prop["id"], prop.get("value")
    if pid.startswith("custom."):
        config = runtime.panelcfg_config(panel_type)
        if config is None or config.field_config_from_json_hook is None:
            return False
        key = pid.removeprefix("custom.")
        return key in config.field_config_from_json_hook({key: value}).to_json()
    return pid in grafana.FieldConfig.from_json({pid: value}).to_json()


def dashboard_problems(data: dict[str, Any]) -> list[str]:
    """What Grafana would not take as written: fields its model drops or changes, unknown panel types,
    unknown override properties, targets of an unknown data source type."""
    back = json.loads(json.dumps(grafana.Dashboard.from_json(data), cls=JSONEncoder))
    problems = round_trip_losses(data, back)
    for panel in all_panels(data):
        kind = panel.get("type")
        if kind != "row" and runtime.panelcfg_config(str(kind)) is None:
            problems.append(f"panel {panel.get('title')!r}: no panel type {kind!r} in Grafana")
        for override in panel.get("fieldConfig", {}).get("overrides", []):
            for prop in override.get("properties", []):
                if not property_known(str(kind), prop):
                    problems.append(f"panel {panel.get('title')!r}: override property {prop['id']!r} unknown")
        for target in panel.get("targets", []):
            if target.get("datasource", {}).get("type") not in runtime.Runtime().dataquery_variants:
                problems.append(
                    f"panel {panel.get('title')!r}: target {target.get('refId')} has no known type"
                )
    return problems


def provisioned_datasource() -> dict[str, Any]:
    [path] = sorted(DATASOURCES.glob("*.yml"))
    config = load_yaml(path)
    assert config["apiVersion"] == 1
    [datasource] = config["datasources"]
    found: dict[str, Any] = datasource
    return found


def compose_service(name: str) -> dict[str, Any]:
    spec: dict[str, Any] = load_yaml(COMPOSE_FILE)["services"][name]
    return spec


def bind_mounts(service: Mapping[str, Any]) -> dict[str, str]:
    """Container path -> repo path of each of the service's bind mounts."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = str(volume).split(":")[:2]
        if source.startswith("./"):
            out[target] = source.removeprefix("./")
    return out


# ------------------------------------------------------------------- the dashboard, by Grafana's SDK


def test_grafanas_own_model_takes_every_field_of_the_dashboard_unchanged() -> None:
    assert dashboard_problems(load_dashboard()) == []


def test_the_sdk_check_reports_misspelt_fields_panel_types_and_override_properties() -> None:
    data = load_dashboard()
    graph = next(p for p in data["panels"] if p["type"] == "timeseries" and p["fieldConfig"]["overrides"])
    stat = next(p for p in data["panels"] if p["type"] == "stat")
    gauge = next(p for p in data["panels"] if p["type"] == "bargauge")
    graph["gridpos"] = graph.pop("gridPos")
    graph["targets"][0]["legendFormatt"] = graph["targets"][0].pop("legendFormat")
    graph["fieldConfig"]["overrides"][0]["properties"][0]["id"] = "custom.linestyle"
    stat["options"]["reduceOptions"]["calc"] = stat["options"]["reduceOptions"].pop("calcs")
    gauge["type"] = "bargauges"
    data["templating"]["list"][0]["multiValue"] = True
    g, s = data["panels"].index(graph), data["panels"].index(stat)

    problems = dashboard_problems(data)

    assert sorted(problems) == sorted(
        [
            f".panels[{s}].options.reduceOptions.calc: not a field Grafana knows here",
            f".panels[{g}].targets[0].legendFormatt: not a field Grafana knows here",
            f".panels[{g}].gridpos: not a field Grafana knows here",
            ".templating.list[0].multiValue: not a field Grafana knows here",
            f"panel {gauge['title']!r}: no panel type 'bargauges' in Grafana",
            f"panel {graph['title']!r}: override property 'custom.linestyle' unknown",
        ]
    )


# ------------------------------------------------------------------------- the dashboard's structure


def test_panels_have_unique_ids_and_fit_the_grid_without_overlapping() -> None:
    panels = all_panels(load_dashboard())
    ids = [p["id"] for p in panels]
    cells: dict[tuple[int, int], str] = {}

    for p in panels:
        pos = p["gridPos"]
        assert pos["w"] > 0 and pos["h"] > 0 and pos["x"] >= 0 and pos["y"] >= 0, p["title"]
        assert pos["x"] + pos["w"] <= GRID_COLUMNS, p["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    assert len({p["title"] for p in panels if p["type"] != "row"}) == len(
        [p for p in panels if p["type"] != "row"]
    )


def test_every_query_names_the_provisioned_data_source_and_a_tokenfleet_or_scrape_metric() -> None:
    uid = provisioned_datasource()["uid"]
    panels = [p for p in all_panels(load_dashboard()) if p["type"] != "row"]

    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": uid}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"], (p["title"], t["refId"])
            names = metric_names(t["expr"])
            assert names, (p["title"], t["expr"])
            assert all(n.startswith("tokenfleet_") or n == "up" for n in names), (p["title"], names)
    assert len(panels) >= 20


def test_every_variable_a_query_uses_is_defined_and_every_defined_one_is_used() -> None:
    data = load_dashboard()
    defined = {v["name"]: v for v in variables(data)}
    used = {name for q in panel_queries(data) for name in variables_used(q.expr)}

    assert used - {"__rate_interval", "__interval"} == set(defined)
    for v in defined.values():
        metric, label = variable_query(v)
        assert metric.startswith("tokenfleet_") and label == v["name"]
        assert v["datasource"]["uid"] == provisioned_datasource()["uid"]
        assert v["includeAll"] and v["multi"] and v["allValue"] == ".*"
    for q in panel_queries(data):
        assert "$" not in fill_in(q.expr, {name: ["x"] for name in defined}, 10.0), q.name


def test_filling_in_a_variable_the_dashboard_does_not_define_is_an_error() -> None:
    with pytest.raises(AssertionError, match=r"\$nope"):
        fill_in('tokenfleet_dataset_tokens{dataset=~"$nope"}', {"dataset": ["a"]}, 1.0)


def test_metric_names_are_the_selected_series_not_functions_labels_or_keywords() -> None:
    expr = (
        'sum by (version) (rate(tokenfleet_a_total{dataset=~"x|y"}[5m])) / on (dataset) group_left '
        "tokenfleet_b or count without (worker) (up) and max_over_time(tokenfleet_c[1m:10s]) > bool 0"
    )

    assert metric_names(expr) == {"tokenfleet_a_total", "tokenfleet_b", "up", "tokenfleet_c"}


def test_variable_values_are_regex_escaped_as_grafana_sends_them() -> None:
    expr = 'tokenfleet_server_up{server=~"$server"}'

    filled = fill_in(expr, {"server": ["http://a.b:1", "http://c:2"]}, 1.0)

    assert filled == 'tokenfleet_server_up{server=~"(http://a\\\\.b:1|http://c:2)"}'


# ------------------------------------------------------------------------------- provisioning, compose


def test_the_provisioned_data_source_is_the_compose_prometheus_at_its_scrape_interval() -> None:
    datasource = provisioned_datasource()
    prometheus = compose_service("prometheus")
    scrape_interval = load_yaml(PROMETHEUS_CONFIG)["global"]["scrape_interval"]

    assert datasource["type"] == "prometheus" and datasource["access"] == "proxy"
    assert datasource["url"] == "http://prometheus:9090"
    assert "--web.listen-address=0.0.0.0:9090" in prometheus["command"]
    assert datasource["jsonData"]["timeInterval"] == scrape_interval
    assert datasource["uid"] == load_dashboard()["panels"][1]["datasource"]["uid"]


def test_the_dashboard_provider_loads_the_folder_compose_mounts_the_dashboards_into() -> None:
    [path] = sorted(DASHBOARD_PROVIDERS.glob("*.yml"))
    config = load_yaml(path)
    [provider] = config["providers"]
    grafana_service = compose_service("grafana")
    mounts = bind_mounts(grafana_service)
    home = grafana_service["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]

    assert config["apiVersion"] == 1 and provider["type"] == "file"
    assert mounts[provider["options"]["path"]] == str(DASHBOARDS.relative_to(REPO))
    assert mounts["/etc/grafana/provisioning"] == str((GRAFANA / "provisioning").relative_to(REPO))
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"
    assert sorted(p.name for p in DASHBOARDS.iterdir()) == [DASHBOARD.name]
    assert orjson.loads(DASHBOARD.read_bytes())["uid"] == "tokenfleet"


def test_prometheus_scrapes_the_metrics_service_on_the_port_it_listens_on() -> None:
    config = load_yaml(PROMETHEUS_CONFIG)
    metrics = compose_service("metrics")
    port = metrics["command"][metrics["command"].index("--port") + 1]
    [job] = config["scrape_configs"]

    assert job["job_name"] == "tokenfleet"
    assert job["static_configs"] == [{"targets": [f"metrics:{port}"]}]
    assert any('up{job="tokenfleet"}' in q.expr for q in panel_queries(load_dashboard()))
    assert re.fullmatch(r"\d+s", config["global"]["scrape_interval"])


def test_promtool_accepts_the_prometheus_config() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if IN_CI:
            pytest.fail("promtool is not installed (apt-get install prometheus; .ci/run does it)")
        pytest.skip("promtool is not installed (apt-get install prometheus)")

    done = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True, timeout=60
    )

    assert done.returncode == 0, done.stdout + done.stderr
