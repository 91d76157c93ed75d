"""The monitoring profile's files as the tests read them (the Grafana dashboard, its provisioning, the
Prometheus config) and a real Prometheus server run from them: each panel's query as Grafana would send it,
with the dashboard's variables and Grafana's interval macros filled in.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx
import orjson
from ruamel.yaml import YAML

REPO: Final = Path(__file__).resolve().parents[2]
COMPOSE_FILE: Final = REPO / "compose.yaml"
MONITORING: Final = REPO / "compose" / "monitoring"
PROMETHEUS_CONFIG: Final = MONITORING / "prometheus.yml"
GRAFANA: Final = MONITORING / "grafana"
DASHBOARDS: Final = GRAFANA / "dashboards"
DATASOURCES: Final = GRAFANA / "provisioning" / "datasources"
DASHBOARD_PROVIDERS: Final = GRAFANA / "provisioning" / "dashboards"
DASHBOARD: Final = DASHBOARDS / "tokenfleet.json"

#: ``label_values(metric, label)``: the one variable query form the dashboard uses.
LABEL_VALUES_RE: Final = re.compile(r"^label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*([a-zA-Z_]\w*)\s*\)$")
#: ``$name``, ``${name}`` and Grafana's ``$__macro`` in a query.
VARIABLE_RE: Final = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
#: Words of PromQL that look like metric names: operators, modifiers, aggregation clauses.
PROMQL_KEYWORDS: Final = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
)
#: Seconds Prometheus may take to start and answer ``/-/ready``.
START_TIMEOUT_S: Final = 20.0


def load_yaml(path: Path) -> Any:
    return YAML(typ="safe").load(path.read_text())


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads(path.read_bytes())
    return data


def all_panels(dashboard: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows and the panels inside collapsed rows included."""
    out: list[dict[str, Any]] = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out += panel.get("panels", [])
    return out


@dataclass(frozen=True)
class PanelQuery:
    """One target of one panel."""

    panel: str
    ref_id: str
    expr: str
    instant: bool

    @property
    def name(self) -> str:
        return f"{self.panel!r} {self.ref_id}"


def panel_queries(dashboard: Mapping[str, Any]) -> list[PanelQuery]:
    return [
        PanelQuery(p["title"], t["refId"], t["expr"], bool(t.get("instant")) and not t.get("range"))
        for p in all_panels(dashboard)
        if p.get("type") != "row"
        for t in p.get("targets", [])
    ]


def variables(dashboard: Mapping[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = dashboard.get("templating", {}).get("list", [])
    return found


def variable_query(variable: Mapping[str, Any]) -> tuple[str, str]:
    """The ``(metric, label)`` of a ``label_values(metric, label)`` query variable."""
    query = variable["query"]
    text = query["query"] if isinstance(query, Mapping) else query
    m = LABEL_VALUES_RE.match(text.strip())
    assert m, f"variable {variable['name']}: not a label_values(metric, label) query: {text!r}"
    return m[1], m[2]


def variables_used(expr: str) -> set[str]:
    return {m[1] or m[2] for m in VARIABLE_RE.finditer(expr)}


def regex_of(values: Sequence[str]) -> str:
    """What Grafana puts in ``=~"$var"`` for several values: each regex-escaped, inside a PromQL string."""
    escaped = [re.escape(v).replace("\\", "\\\\") for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def fill_in(expr: str, values: Mapping[str, Sequence[str]], scrape_interval_s: float) -> str:
    """``expr`` as Grafana sends it: each variable replaced by its values, ``$__rate_interval`` by four
    scrape intervals (Grafana's floor for it) and ``$__interval`` by one. An unknown variable is an error."""
    macros = {
        "__rate_interval": f"{round(4 * scrape_interval_s * 1000)}ms",
        "__interval": f"{round(scrape_interval_s * 1000)}ms",
    }

    def one(m: re.Match[str]) -> str:
        name = m[1] or m[2]
        if name in macros:
            return macros[name]
        assert name in values, f"{expr!r} uses ${name}, which is no variable of the dashboard"
        return regex_of(values[name])

    return VARIABLE_RE.sub(one, expr)


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (not its functions, keywords, labels or durations)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery durations
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(\s*\()?", text):
        if not m[2] and m[1] not in PROMQL_KEYWORDS:
            names.add(m[1])
    return names


# ------------------------------------------------------------------------------------- a real Prometheus


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def compose_prometheus_args(storage: Path, config: Path, port: int) -> list[str]:
    """The ``prometheus`` service's own command from ``compose.yaml``, with its container paths and
    address mapped to this machine (``${VAR:-default}`` takes the default)."""
    spec = load_yaml(COMPOSE_FILE)["services"]["prometheus"]
    mapped = {"--config.file": str(config), "--storage.tsdb.path": str(storage)}
    out = []
    for arg in spec["command"]:
        arg = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(arg))
        flag, _, value = arg.partition("=")
        if flag in mapped:
            arg = f"{flag}={mapped[flag]}"
        elif flag == "--web.listen-address":
            assert value.endswith(":9090"), value
            arg = f"{flag}=127.0.0.1:{port}"
        out.append(arg)
    return out


def local_prometheus_config(metrics_target: str, scrape_interval_s: float) -> dict[str, Any]:
    """``compose/monitoring/prometheus.yml`` pointed at ``metrics_target`` instead of ``metrics:9808``,
    scraping every ``scrape_interval_s`` (the file's own interval is for days, not for a test)."""
    config: dict[str, Any] = load_yaml(PROMETHEUS_CONFIG)
    interval = f"{round(scrape_interval_s * 1000)}ms"
    config["global"] |= {"scrape_interval": interval, "evaluation_interval": interval}
    for job in config["scrape_configs"]:
        job.pop("scrape_interval", None)
        for static in job["static_configs"]:
            static["targets"] = [metrics_target if t == "metrics:9808" else t for t in static["targets"]]
    return config


class Prometheus:
    """A Prometheus server (the Debian package's binary) and its HTTP query API."""

    def __init__(self, binary: str, folder: Path, args: list[str], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = folder / "prometheus.log"
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([binary, *args], stdout=out, stderr=subprocess.STDOUT, cwd=folder)
        self.client = httpx.Client(base_url=self.url, timeout=10)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if self.client.get("/-/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus did not start:\n{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def api(self, path: str, **params: Any) -> Any:
        reply = self.client.get(f"/api/v1/{path}", params=params)
        body = reply.json()
        assert reply.status_code == 200 and body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as one sample) of ``expr`` now."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
        data = self.api("query_range", query=expr, start=start, end=end, step=step_s)
        result: list[dict[str, Any]] = data["result"]
        return result

    def metric_names(self) -> set[str]:
        return set(self.api("label/__name__/values"))

    def label_values(self, label: str, metric: str) -> list[str]:
        values: list[str] = self.api(f"label/{label}/values", **{"match[]": metric})
        return values

    def targets_up(self) -> Iterator[dict[str, Any]]:
        yield from self.api("targets")["activeTargets"]

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
