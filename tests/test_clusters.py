"""The shipped cluster configs and the Dockerfile work as shipped: valid for the tools that read
them, consistent with each other and with raycl, and safe (dashboard and MLflow on loopback,
Ray's token authentication on, no credentials, nothing installed from a name PyPI does not have).

Each check is a function that lists the problems it finds, so that
``test_checks_catch_the_defects_they_exist_for`` can show every check reporting the defect it
exists for (the configs this file replaced had most of them).
There is no Docker daemon in CI: the Dockerfile's `pip install` is performed without one, on a
copy of the build context (see ``test_dockerfile_pip_install_*``).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

import raycl.server
import raycl.tune

REPO = Path(__file__).resolve().parents[1]
CLUSTERS = REPO / "clusters"
DOCKERFILE = REPO / "Dockerfile"
DOCS = REPO / "docs" / "clusters.md"
RAY_VERSION = ray.__version__
AUTH_TOKEN = "~/.ray/auth_token"
PIP_TIMEOUT_S = 120


def _load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


FILES = sorted(CLUSTERS.glob("*.yaml"))
LAUNCHER = [p for p in FILES if "kind" not in _load_all(p)[0]]
KUBERAY = [p for p in FILES if p not in LAUNCHER]


# ---------------------------------------------------------------------------------------------
# Shell commands in the launcher configs


def _segments(command: str) -> list[list[str]]:
    """A shell command line as its simple commands (split on ; && || | &), each as words."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    segments: list[list[str]] = [[]]
    for token in lexer:
        if token and set(token) <= set(";&|"):
            segments.append([])
        else:
            segments[-1].append(token)
    return [s for s in segments if s]


def _strip_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading VAR=value assignments of a simple command, and the command after them."""
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        key, _, value = words[0].partition("=")
        env[key] = value
        words = words[1:]
    return env, words


def _command_args(words: list[str]) -> list[str]:
    """Arguments up to the first redirection."""
    out: list[str] = []
    for word in words:
        if word in ("<", ">", ">>", "2>", "2>&1") or word.startswith((">", "<")):
            break
        out.append(word)
    return out


def _flag(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1:]
    return None


def _pip_requirements(args: list[str]) -> list[str]:
    """The requirements of `pip install ARGS` (options and their values dropped)."""
    takes_value = {"-r", "--requirement", "-c", "--constraint", "-i", "--index-url",
                   "--extra-index-url", "-f", "--find-links", "-t", "--target", "--python"}
    reqs, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in takes_value:
            skip = True
        elif not arg.startswith("-"):
            reqs.append(arg)
    return reqs


def _is_path(req: str) -> bool:
    return req.startswith((".", "/", "~", "$")) or "/" in req.split("[")[0]


def _pip_installs(commands: list[str]) -> list[list[str]]:
    """The requirement lists of every `pip install` in these commands."""
    found = []
    for command in commands:
        for words in _segments(command):
            _, words = _strip_env(words)
            if "pip" in words and "install" in words[words.index("pip"):]:
                rest = words[words.index("install", words.index("pip")) + 1:]
                found.append(_pip_requirements(_command_args(rest)))
    return found


# ---------------------------------------------------------------------------------------------
# Launcher configs (ray up)


# What building raycl needs from the checkout: the project file, the readme it names, the package.
INSTALL_SOURCES = ("pyproject.toml", "README.md", "raycl")


def _same_local(value: Any, path: str) -> bool:
    """Whether a file_mounts source is `path` of the repository (`ray up` runs at its root)."""
    return isinstance(value, str) and (REPO / value).resolve() == (REPO / path).resolve()


AWS_GPU_FAMILIES = re.compile(r"^(p\d+[a-z]*|g\d+[a-z]*|gr\d+)\.")  # p3, p4d, p5, g4dn, g5, g6e
GCP_GPU_MACHINES = re.compile(r"^(a\d+|g\d+)-")  # a2, a3, g2, g4: the GPUs come attached


def _is_gpu_node(provider: str, node_config: dict[str, Any]) -> bool:
    if provider == "aws":
        return bool(AWS_GPU_FAMILIES.match(str(node_config.get("InstanceType", ""))))
    if provider == "gcp":
        machine = str(node_config.get("machineType", "")).rsplit("/", 1)[-1]
        return bool(node_config.get("guestAccelerators")) or bool(GCP_GPU_MACHINES.match(machine))
    return False


def launcher_problems(config: dict[str, Any]) -> list[str]:
    """What keeps a `ray up` config from working as shipped, or from being safe."""
    problems: list[str] = []
    provider = config.get("provider", {}).get("type")
    head_cmds = [str(c) for c in config.get("head_start_ray_commands", [])]
    worker_cmds = [str(c) for c in config.get("worker_start_ray_commands", [])]
    setup = [str(c) for key in ("setup_commands", "head_setup_commands", "worker_setup_commands")
             for c in config.get(key, [])]

    # Node types: the head runs no trials, GPU workers start from zero and declare their GPUs.
    if provider in ("aws", "gcp"):
        types = config.get("available_node_types", {})
        head = config.get("head_node_type")
        if head not in types:
            problems.append(f"head_node_type {head!r} is not in available_node_types")
        else:
            resources = types[head].get("resources", {})
            if resources.get("CPU") != 0 or resources.get("GPU", 0) != 0:
                problems.append(f"head node type {head!r} must declare resources CPU: 0 (no "
                                f"trials on the head), has {resources}")
        workers = {k: v for k, v in types.items() if k != head}
        if not any(_is_gpu_node(provider, v.get("node_config", {})) for v in workers.values()):
            problems.append("no GPU worker node type")
        for name, node in types.items():
            resources = node.get("resources", {})
            if _is_gpu_node(provider, node.get("node_config", {})):
                if resources.get("GPU", 0) < 1 or resources.get("CPU", 0) < 1:
                    problems.append(f"GPU node type {name!r} must declare its CPU and GPU "
                                    f"resources, declares {resources}")
                scheduling = node["node_config"].get("scheduling", {})
                if provider == "gcp" and (not isinstance(scheduling, dict) or
                                          scheduling.get("onHostMaintenance") != "TERMINATE"):
                    problems.append(f"GCP GPU node type {name!r} needs scheduling: "
                                    f"{{onHostMaintenance: TERMINATE}}")
            elif resources.get("GPU", 0):
                problems.append(f"node type {name!r} declares GPUs its instance type lacks")
        for name, node in workers.items():
            if node.get("min_workers", 0) != 0 or node.get("max_workers", 0) < 1:
                problems.append(f"worker type {name!r} must scale from min_workers: 0 to "
                                f"max_workers >= 1")
            if node.get("max_workers", 0) > config.get("max_workers", 0):
                problems.append(f"worker type {name!r} max_workers exceeds the cluster's")

    # Ray starts with token authentication everywhere, the dashboard on loopback.
    starts = [(cmd, words) for cmd in head_cmds + worker_cmds for words in _segments(cmd)
              if "ray" in words and "start" in words]
    if not any("--head" in words for _, words in starts):
        problems.append("head_start_ray_commands has no `ray start --head`")
    for cmd, words in starts:
        env, args = _strip_env(words)
        if env.get("RAY_AUTH_MODE") != "token":
            problems.append(f"`ray start` without RAY_AUTH_MODE=token: {cmd!r}")
        if "--head" in args and _flag(args, "--dashboard-host") not in ("127.0.0.1", "localhost"):
            problems.append(f"the dashboard must be bound to 127.0.0.1: {cmd!r}")
    if config.get("file_mounts", {}).get(AUTH_TOKEN) != AUTH_TOKEN:
        problems.append(f"file_mounts must copy {AUTH_TOKEN} to every node (workers need the "
                        f"head's token)")

    # MLflow runs on the head, on loopback, with arguments raycl.server accepts.
    servers = [words for cmd in head_cmds for words in _segments(cmd) if "raycl.server" in words]
    if not servers:
        problems.append("head_start_ray_commands does not start `python -m raycl.server`")
    for words in servers:
        argv = _command_args(words[words.index("raycl.server") + 1:])
        try:
            raycl.server.server_command(raycl.server.parse_args(argv))
        except (ValueError, SystemExit) as exc:
            problems.append(f"python -m raycl.server {' '.join(argv)}: {exc}")

    # raycl comes from the checkout file_mounts copies; Ray is the version raycl is tested with.
    mounts = config.get("file_mounts", {})
    installs = [req for reqs in _pip_installs(setup) for req in reqs]
    raycl_paths = [r for r in installs if _is_path(r) and re.fullmatch(
        r"raycl(-[^/]+\.whl)?", r.split("[")[0].rstrip("/").rsplit("/")[-1])]
    for req in installs:
        if not _is_path(req) and canonicalize_name(Requirement(req).name) == "raycl":
            problems.append(f"pip installs raycl by name ({req!r}): it is not on PyPI")
    if not raycl_paths:
        problems.append("no setup command installs raycl from the copied checkout")
    for req in raycl_paths:
        remote = re.sub(r"^(\$HOME|\$\{HOME\})", "~", req.split("[")[0].rstrip("/"))
        if remote.endswith(".whl"):   # a pinned wheel: file_mounts copies it from dist/
            if not str(mounts.get(remote, "")).endswith(remote.rsplit("/", 1)[-1]):
                problems.append(f"pip installs {req!r} but file_mounts does not copy it there")
            continue
        copied = {name for name in INSTALL_SOURCES
                  if _same_local(mounts.get(f"{remote}/{name}"), name)}
        if not _same_local(mounts.get(remote), ".") and copied != set(INSTALL_SOURCES):
            problems.append(f"pip installs {req!r} but file_mounts does not copy the checkout "
                            f"(or {', '.join(INSTALL_SOURCES)}) there")
    rays = [Requirement(r) for r in installs
            if not _is_path(r) and canonicalize_name(Requirement(r).name) == "ray"]
    if [str(r.specifier) for r in rays] != [f"=={RAY_VERSION}"]:
        problems.append(f"setup must pin ray=={RAY_VERSION} (the version raycl is tested with), "
                        f"pins {[str(r) for r in rays]}")
    return problems


# ---------------------------------------------------------------------------------------------
# The Dockerfile


@dataclass
class Dockerfile:
    base: str
    workdir: str
    copies: list[tuple[str, str]]
    pip_args: list[str]
    tag: str | None
    runs: list[str] = field(default_factory=list)

    @property
    def requirements(self) -> list[str]:
        return _pip_requirements(self.pip_args)


def parse_dockerfile(text: str) -> Dockerfile:
    """The instructions the checks need (continuation lines joined, comments dropped)."""
    tag = None
    for line in text.splitlines():
        if line.lstrip().startswith("#") and "docker build" in line:
            words = shlex.split(line.lstrip("# "))
            tag = _flag(words, "-t") or _flag(words, "--tag")
    logical, buf = [], ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    base, workdir, copies, pip_args, runs = "", "/", [], [], []
    for line in logical:
        instruction, _, rest = line.strip().partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            base = rest.split()[0]
        elif instruction == "WORKDIR":
            workdir = str(Path(workdir) / rest.strip())
        elif instruction == "COPY":
            words = [w for w in shlex.split(rest) if not w.startswith("--")]
            copies += [(src, str(Path(workdir) / words[-1])) for src in words[:-1]]
        elif instruction == "RUN":
            runs.append(rest)
            for words in _segments(rest):
                if "pip" in words and "install" in words:
                    pip_args = words[words.index("install") + 1:]
    return Dockerfile(base, workdir, copies, pip_args, tag, runs)


DOCKER = parse_dockerfile(DOCKERFILE.read_text())


def dockerfile_problems(docker: Dockerfile) -> list[str]:
    problems = []
    match = re.fullmatch(r"rayproject/ray:(?P<ray>[\d.]+)-py(?P<py>\d+)-(gpu|cu\d+)", docker.base)
    if not match:
        problems.append(f"FROM {docker.base}: not a rayproject/ray GPU image")
    elif match["ray"] != RAY_VERSION:
        problems.append(f"FROM {docker.base}: Ray {match['ray']}, raycl is tested with "
                        f"{RAY_VERSION}")
    if ("." , docker.workdir) not in docker.copies:
        problems.append("the build context is not copied to the WORKDIR (COPY . .)")
    reqs = docker.requirements
    if not any(r.startswith(".[") and "gpu" in r for r in reqs):
        problems.append(f"pip install does not install the checkout with its gpu extra: {reqs}")
    if f"ray[default,train,tune]=={RAY_VERSION}" not in reqs:
        problems.append(f"pip install must pin ray[default,train,tune]=={RAY_VERSION}")
    if any(not _is_path(r) and canonicalize_name(Requirement(r).name) == "raycl" for r in reqs):
        problems.append("pip installs raycl by name: it is not on PyPI")
    project = _project_version()
    if docker.tag is None or not re.fullmatch(rf"[^:\s]+/raycl:{re.escape(project)}", docker.tag):
        problems.append(f"the documented `docker build -t` tag must be REGISTRY/raycl:{project}, "
                        f"is {docker.tag!r}")
    return problems


def _project_version() -> str:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


# ---------------------------------------------------------------------------------------------
# KubeRay manifests


def _cluster_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc.get("kind") == "RayCluster":
        return doc["spec"]
    if doc.get("kind") == "RayJob":
        return doc["spec"]["rayClusterSpec"]
    return None


def _containers(group: dict[str, Any]) -> list[dict[str, Any]]:
    return group["template"]["spec"]["containers"]


def _gpus(container: dict[str, Any]) -> int:
    return int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


def kuberay_problems(docs: list[dict[str, Any]], docker: Dockerfile) -> list[str]:
    problems: list[str] = []
    claims = {d["metadata"]["name"] for d in docs if d.get("kind") == "PersistentVolumeClaim"}
    specs = [s for s in map(_cluster_spec, docs) if s is not None]
    if not specs:
        problems.append("no RayCluster or RayJob")
    for spec in specs:
        head = spec["headGroupSpec"]
        workers = spec.get("workerGroupSpecs", [])
        if str(spec.get("rayVersion")) != RAY_VERSION:
            problems.append(f"rayVersion {spec.get('rayVersion')!r}, raycl is tested with "
                            f"{RAY_VERSION}")
        # Groups that start at zero pods only ever grow with KubeRay's in-tree autoscaler.
        for group in workers:
            if (min(group.get("replicas", 0), group.get("minReplicas", 0)) == 0
                    and spec.get("enableInTreeAutoscaling") is not True):
                problems.append(f"worker group {group['groupName']!r} starts at 0 replicas but "
                                f"enableInTreeAutoscaling is not true: it would never start")
            if group.get("maxReplicas", 0) < 1:
                problems.append(f"worker group {group['groupName']!r} has maxReplicas < 1")
        # The image the Dockerfile builds, everywhere.
        for group in [head, *workers]:
            for container in _containers(group):
                if container.get("image") != docker.tag:
                    problems.append(f"container {container['name']!r} runs "
                                    f"{container.get('image')!r}, not the Dockerfile's "
                                    f"{docker.tag!r}")
        # No trials on the head; GPU groups ask Kubernetes for GPUs.
        if str(head.get("rayStartParams", {}).get("num-cpus")) != "0":
            problems.append("the head group must set rayStartParams num-cpus: \"0\"")
        if any(_gpus(c) for c in _containers(head)):
            problems.append("the head pod requests a GPU")
        for group in workers:
            ray_container = _containers(group)[0]
            wants_gpu = "gpu" in group["groupName"].lower() or group.get(
                "rayStartParams", {}).get("num-gpus")
            if wants_gpu and _gpus(ray_container) < 1:
                problems.append(f"GPU worker group {group['groupName']!r} does not request "
                                f"nvidia.com/gpu")
        if not any(_gpus(_containers(g)[0]) >= 1 for g in workers):
            problems.append("no worker group requests nvidia.com/gpu")
        # Ray's token authentication.
        auth = spec.get("authOptions", {})
        if auth.get("mode") != "token" or not auth.get("secretName"):
            problems.append("authOptions must be {mode: token, secretName: ...} (the token "
                            "`ray job submit` sends must be the cluster's)")
        # MLflow beside the head, on loopback, its database on a persistent volume.
        servers = [c for c in _containers(head)
                   if "raycl.server" in (c.get("command", []) + c.get("args", []))]
        if not servers:
            problems.append("the head pod has no `python -m raycl.server` container")
        for container in servers:
            words = container.get("command", []) + container.get("args", [])
            argv = [str(w) for w in words[words.index("raycl.server") + 1:]]
            try:
                args = raycl.server.parse_args(argv)
                raycl.server.server_command(args)
            except (ValueError, SystemExit) as exc:
                problems.append(f"mlflow container: raycl.server {argv}: {exc}")
                continue
            database = Path(args.backend_store_uri.removeprefix("sqlite:///"))
            volumes = {v["name"]: v for v in head["template"]["spec"].get("volumes", [])}
            mounts = [m for m in container.get("volumeMounts", [])
                      if database.is_relative_to(m["mountPath"])]
            claim = (volumes.get(mounts[0]["name"], {}).get("persistentVolumeClaim", {})
                     .get("claimName") if mounts else None)
            if args.backend_store_uri.startswith("sqlite:") and claim not in claims:
                problems.append(f"MLflow's database {database} is not on a PersistentVolumeClaim "
                                f"defined in this file: it would go with the pod")
            if not args.artifacts_destination.startswith(("s3://", "gs://")):
                problems.append("MLflow's artifacts must go to the bucket")
    for doc in docs:
        if doc.get("kind") == "RayJob":
            problems += rayjob_problems(doc, docker)
    return problems


def rayjob_problems(job: dict[str, Any], docker: Dockerfile) -> list[str]:
    problems = []
    entry = shlex.split(job["spec"]["entrypoint"])
    if entry[:4] != ["python", "-m", "raycl.tune", "searches/mcl_k_n.yaml"]:
        return [f"the entrypoint must be `python -m raycl.tune searches/mcl_k_n.yaml ...`, is "
                f"{job['spec']['entrypoint']!r}"]
    if not (REPO / entry[3]).is_file():
        problems.append(f"{entry[3]} does not exist")
    args = raycl.tune.parse_args(entry[3:])
    args.search = str(REPO / args.search)
    config = raycl.tune.resolve(args)
    if not config.tune.storage_path.startswith(("s3://", "gs://")):
        problems.append(f"--storage {config.tune.storage_path}: pods share no disk; use a bucket")
    if config.mlflow.tracking_uri != "http://127.0.0.1:5000":
        problems.append(f"--tracking-uri {config.mlflow.tracking_uri}: the driver runs on the "
                        f"head, MLflow beside it on http://127.0.0.1:5000")
    spec = job["spec"]["rayClusterSpec"]
    if config.scaling.use_gpu and not any(_gpus(_containers(g)[0])
                                          for g in spec.get("workerGroupSpecs", [])):
        problems.append("scaling.use_gpu=true but no worker group has GPUs")
    runtime_env = yaml.safe_load(job["spec"].get("runtimeEnvYAML", "") or "") or {}
    if runtime_env.get("working_dir") != docker.workdir:
        problems.append(f"runtimeEnvYAML working_dir must be the image's checkout "
                        f"({docker.workdir}), is {runtime_env.get('working_dir')!r}")
    return problems


# ---------------------------------------------------------------------------------------------
# Text of every shipped file


SECRETS = [
    (re.compile(r"(?<![A-Z0-9])(AKIA|ASIA)[A-Z0-9]{16}(?![A-Z0-9])"), "an AWS access key id"),
    (re.compile(r"aws_secret_access_key", re.I), "an AWS secret key"),
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY"), "a private key"),
    (re.compile(r"\"private_key\"\s*:"), "a service-account key"),
    (re.compile(r"password\s*[:=]", re.I), "a password"),
    (re.compile(r"token\s*[:=]\s*['\"]?[A-Za-z0-9_\-]{20,}", re.I), "a token"),
]


def text_problems(text: str) -> list[str]:
    problems = []
    if "0.0.0.0" in text:
        problems.append("binds or opens 0.0.0.0")
    for pattern, what in SECRETS:
        if pattern.search(text):
            problems.append(f"contains what looks like {what}")
    return problems


# ---------------------------------------------------------------------------------------------
# The tests


@pytest.mark.parametrize("path", LAUNCHER, ids=lambda p: p.name)
def test_launcher_configs_match_rays_schema(path: Path) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(path.read_text())
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    # What `ray up` does first: fill in the provider's defaults, validate the result.
    validate_config(prepare_config(config))


@pytest.mark.parametrize("path", LAUNCHER, ids=lambda p: p.name)
def test_launcher_configs_work_as_shipped(path: Path) -> None:
    assert launcher_problems(yaml.safe_load(path.read_text())) == []


def test_launcher_configs_cover_aws_gcp_and_own_machines() -> None:
    providers = {yaml.safe_load(p.read_text())["provider"]["type"] for p in LAUNCHER}
    assert providers == {"aws", "gcp", "local"}


@pytest.mark.parametrize("path", KUBERAY, ids=lambda p: p.name)
def test_kuberay_manifests_work_as_shipped(path: Path) -> None:
    assert kuberay_problems(_load_all(path), DOCKER) == []


def test_kuberay_has_a_raycluster_and_a_rayjob_on_the_same_cluster_spec() -> None:
    kinds = {d["kind"]: d for p in KUBERAY for d in _load_all(p)}
    assert {"RayCluster", "RayJob"} <= set(kinds)
    assert kinds["RayJob"]["spec"]["rayClusterSpec"] == kinds["RayCluster"]["spec"]


@pytest.mark.parametrize("path", [*FILES, DOCKERFILE, REPO / ".dockerignore"],
                         ids=lambda p: p.name)
def test_no_credentials_or_wildcard_binds(path: Path) -> None:
    assert text_problems(path.read_text()) == []


def test_dockerfile_builds_the_image_the_manifests_name() -> None:
    assert dockerfile_problems(DOCKER) == []


def test_dockerignore_leaves_out_what_gitignore_does() -> None:
    ignored = _dockerignore()
    missing = [p for p in _patterns(REPO / ".gitignore")
               if p.rstrip("/") not in ignored and "**/" + p.rstrip("/") not in ignored]
    assert ".git" in ignored
    assert missing == []


def test_cluster_docs_commands_parse() -> None:
    """Every `python -m raycl.tune ...` in docs/clusters.md is one raycl accepts."""
    text = DOCS.read_text().replace("\\\n", " ")
    commands = re.findall(r"python -m raycl\.tune (searches/\S+\.yaml[^\n`]*)", text)
    assert commands
    for command in commands:
        args = raycl.tune.parse_args(shlex.split(command.replace("$", "")))
        args.search = str(REPO / args.search)
        raycl.tune.resolve(args)


def test_checks_catch_the_defects_they_exist_for() -> None:
    """The defects of the configs this file replaced, and a few more: each check reports its
    own. A check that passes them all is not a check."""
    aws = yaml.safe_load((CLUSTERS / "aws-gpu.yaml").read_text())
    gcp = yaml.safe_load((CLUSTERS / "gcp-gpu.yaml").read_text())
    local = yaml.safe_load((CLUSTERS / "local.yaml").read_text())

    def edited(config: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
        config = json.loads(json.dumps(config))
        *keys, last = path.split(".")
        node = config
        for key in keys:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is None:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
        return config

    def reported(problems: list[str], words: str) -> bool:
        return any(words in p for p in problems)

    old_start = ("ray start --head --port=6379 --dashboard-host=0.0.0.0 "
                 "--autoscaling-config=~/ray_bootstrap_config.yaml")
    old_setup = ['pip install -U "raycl[gpu] @ git+https://github.com/YOUR-ORG/raycl.git" '
                 '|| pip install -U raycl']
    cases = [
        (edited(aws, "head_start_ray_commands", ["ray stop", old_start]), "0.0.0.0"),
        (edited(aws, "head_start_ray_commands", ["ray stop", old_start]), "RAY_AUTH_MODE"),
        (edited(aws, "head_start_ray_commands", ["ray stop", old_start]), "raycl.server"),
        (edited(local, "setup_commands", old_setup), "by name"),
        (edited(local, "setup_commands", old_setup), "pin ray"),
        (edited(aws, "available_node_types.gpu_worker.resources", {}), "CPU and GPU"),
        (edited(aws, "available_node_types.head.resources", {}), "CPU: 0"),
        (edited(aws, "head_node_type", "ray.head"), "head_node_type"),
        (edited(aws, "available_node_types.gpu_worker.min_workers", 1), "min_workers: 0"),
        (edited(aws, "available_node_types.gpu_worker.node_config.InstanceType", "m6i.2xlarge"),
         "no GPU worker"),
        (edited(aws, "file_mounts", {"~/raycl": "."}), "auth_token"),
        (edited(aws, "file_mounts", {AUTH_TOKEN: AUTH_TOKEN}), "file_mounts does not copy"),
        (edited(aws, "file_mounts", {k: v for k, v in aws["file_mounts"].items()
                                     if not k.endswith("README.md")}), "file_mounts does not copy"),
        (edited(aws, "setup_commands.3", 'python -m pip install "ray[default,train,tune]=='
                f'{RAY_VERSION}" "$HOME/raycl-0.1.0-py3-none-any.whl[gpu]"'),
         "does not copy it there"),
        (edited(gcp, "available_node_types.gpu_worker.node_config.scheduling", None),
         "onHostMaintenance"),
        (edited(aws, "worker_start_ray_commands.1", "ray start --address=$RAY_HEAD_IP:6379"),
         "RAY_AUTH_MODE"),
        (edited(aws, "head_start_ray_commands.2",
                "nohup python -m raycl.server --host 10.0.0.5 > log 2>&1 &"), "--host 10.0.0.5"),
    ]
    for config, words in cases:
        problems = launcher_problems(config)
        assert reported(problems, words), (words, problems)
    # The pinned-wheel variant docs/clusters.md describes passes.
    wheel = "raycl-0.1.0-py3-none-any.whl"
    pinned = edited(aws, "setup_commands.3", f'python -m pip install "ray[default,train,tune]=='
                                             f'{RAY_VERSION}" "$HOME/{wheel}[gpu]"')
    pinned["file_mounts"] = {f"~/{wheel}": f"dist/{wheel}", AUTH_TOKEN: AUTH_TOKEN}
    assert launcher_problems(pinned) == []

    # clusters/kuberay-rayjob.yaml before this file's checks existed.
    old_kuberay = yaml.safe_load("""
apiVersion: ray.io/v1
kind: RayJob
metadata: {name: raycl-mcl-k-n}
spec:
  entrypoint: >-
    python -m raycl.tune searches/mcl_k_n.yaml
    --storage s3://YOUR-BUCKET/raycl --tracking-uri http://mlflow.mlflow.svc:5000
    --set scaling.use_gpu=true --set scaling.num_workers=2
  rayClusterSpec:
    rayVersion: "2.60.0"
    headGroupSpec:
      rayStartParams: {num-cpus: "0"}
      template:
        spec:
          containers:
            - {name: ray-head, image: "YOUR-REGISTRY/raycl:latest"}
    workerGroupSpecs:
      - groupName: gpu
        replicas: 0
        minReplicas: 0
        maxReplicas: 8
        rayStartParams: {}
        template:
          spec:
            containers:
              - name: ray-worker
                image: "YOUR-REGISTRY/raycl:latest"
                resources: {limits: {cpu: "8", memory: 32Gi, nvidia.com/gpu: "1"}}
""")
    problems = kuberay_problems([old_kuberay], DOCKER)
    for words in ["enableInTreeAutoscaling", "not the Dockerfile's", "authOptions",
                  "raycl.server", "--tracking-uri", "working_dir"]:
        assert reported(problems, words), (words, problems)
    job = next(d for d in _load_all(CLUSTERS / "kuberay-rayjob.yaml") if d["kind"] == "RayJob")
    for path, value, words in [
            ("spec.rayClusterSpec.headGroupSpec.rayStartParams", {}, "num-cpus"),
            ("spec.rayClusterSpec.workerGroupSpecs.0.template.spec.containers.0.resources", {},
             "does not request nvidia.com/gpu"),
            ("spec.rayClusterSpec.enableInTreeAutoscaling", None, "enableInTreeAutoscaling"),
            ("spec.rayClusterSpec.headGroupSpec.template.spec.volumes", [], "PersistentVolume"),
            ("spec.entrypoint", "python -m raycl.tune searches/mcl_k_n.yaml --storage /tmp/x "
             "--tracking-uri http://127.0.0.1:5000 --set scaling.use_gpu=true", "--storage"),
            ("spec.rayClusterSpec.rayVersion", "2.9.0", "rayVersion")]:
        problems = kuberay_problems([edited(job, path, value)], DOCKER)
        assert reported(problems, words), (words, problems)

    old_docker = parse_dockerfile('FROM rayproject/ray:2.9.0-py310-gpu\n'
                                  'RUN pip install -U raycl\n')
    problems = dockerfile_problems(old_docker)
    for words in ["Ray 2.9.0", "COPY", "gpu extra", "pin ray", "by name", "docker build"]:
        assert reported(problems, words), (words, problems)

    for text, words in [("--dashboard-host=0.0.0.0", "0.0.0.0"),
                        ("key: AKIAABCDEFGHIJKLMNOP", "access key"),
                        ("aws_secret_access_key = x", "secret key"),
                        ("-----BEGIN OPENSSH PRIVATE KEY-----", "private key"),
                        ("password: hunter2", "password"),
                        ("token: abcdefghijklmnopqrstuvwxyz0123", "a token")]:
        assert reported(text_problems(text), words), (words, text)


# ---------------------------------------------------------------------------------------------
# The Dockerfile's pip install, without Docker


def _patterns(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith(("#", "!"))]


def _dockerignore() -> list[str]:
    return [p.rstrip("/") for p in _patterns(REPO / ".dockerignore")]


def _ignored(relative: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore matching, as far as the patterns here need: relative to the
    context root, `**` for any number of directories, a match on a directory covers it all."""
    parts = relative.split("/")

    def match(pattern: list[str], path: list[str]) -> bool:
        if not pattern:
            return not path
        if pattern[0] == "**":
            return any(match(pattern[1:], path[i:]) for i in range(len(path) + 1))
        return bool(path) and fnmatchcase(path[0], pattern[0]) and match(pattern[1:], path[1:])

    return any(match(p.split("/"), parts[:n]) for p in patterns for n in range(1, len(parts) + 1))


def _build_context(dest: Path) -> Path:
    """A copy of what `docker build .` sends: the repository minus .dockerignore."""
    patterns = _dockerignore()
    for root, dirs, files in os.walk(REPO):
        rel_root = Path(root).relative_to(REPO)
        dirs[:] = [d for d in dirs if not _ignored((rel_root / d).as_posix(), patterns)]
        for name in files:
            rel = (rel_root / name).as_posix()
            if not _ignored(rel, patterns):
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                (dest / rel).write_bytes((REPO / rel).read_bytes())
    return dest


def _pip(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=PIP_TIMEOUT_S)


@pytest.fixture(scope="module")
def build_context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    context = _build_context(tmp_path_factory.mktemp("context"))
    assert not (context / ".git").exists() and not (context / ".venv").exists()
    return context


@pytest.fixture(scope="module")
def built_wheel(build_context: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """raycl's wheel built from the Docker build context, as the Dockerfile's `pip install .`
    builds it (no isolation: setuptools is in this environment already, nothing to fetch)."""
    out = tmp_path_factory.mktemp("wheel")
    result = _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out),
                  str(build_context))
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = out.glob("raycl-*.whl")
    return wheel


def test_dockerfile_pip_install_builds_raycl_from_the_build_context(
        build_context: Path, built_wheel: Path, tmp_path: Path) -> None:
    context_sources = {p.relative_to(REPO).as_posix() for p in (REPO / "raycl").rglob("*.py")
                       if not _ignored(p.relative_to(REPO).as_posix(), _dockerignore())}
    with zipfile.ZipFile(built_wheel) as wheel:
        names = set(wheel.namelist())
        entry_points = next(wheel.read(n).decode() for n in names
                            if n.endswith(".dist-info/entry_points.txt"))
    assert context_sources - names == set()
    assert {"raycl/methods/simclr.py", "raycl/tune.py", "raycl/server.py"} <= names
    assert "raycl-tune = raycl.tune:main" in entry_points
    # The Dockerfile's own `pip install` of the checkout (its options, its `.[gpu]`, run in the
    # WORKDIR holding the context), into a directory instead of the image's environment and
    # without dependencies (the next test looks those up on the index). Installed, not imported
    # from the source tree, it imports with the dependencies of this environment.
    options = [a for a in DOCKER.pip_args if a.startswith("-")]
    (local,) = [r for r in DOCKER.requirements if _is_path(r)]
    target = tmp_path / "site"
    result = _pip("install", *options, "--no-deps", "--no-build-isolation",
                  "--target", str(target), local, cwd=build_context)
    assert result.returncode == 0, result.stdout + result.stderr
    probe = subprocess.run(
        [sys.executable, "-c", "import raycl, raycl.methods, raycl.server, raycl.tune; "
                               "print(raycl.__file__)"],
        capture_output=True, text=True, cwd=tmp_path, timeout=PIP_TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": str(target)})
    assert probe.returncode == 0, probe.stderr
    assert Path(probe.stdout.strip()).is_relative_to(target)
    # The RayJob runs the search file from the image's checkout.
    assert not _ignored("searches/mcl_k_n.yaml", _dockerignore())


def _index_versions(name: str) -> list[Version] | str:
    """The versions the package index offers this interpreter, or pip's error."""
    result = _pip("index", "versions", name)
    found = re.search(r"Available versions: (.*)", result.stdout)
    if result.returncode != 0 or not found:
        return (result.stderr.strip().splitlines() or ["no output"])[-1]
    versions = []
    for text in found.group(1).split(","):
        with contextlib.suppress(InvalidVersion):
            versions.append(Version(text.strip()))
    return versions


def test_dockerfile_pip_install_resolves_against_the_index(built_wheel: Path) -> None:
    """Every requirement of the Dockerfile's `pip install` -- its own arguments and raycl's
    dependencies with the gpu extra -- has a version on the package index for the image's Python.

    Not a full `pip install --dry-run`: the resolver downloads each candidate wheel to read its
    dependencies (torch and the CUDA libraries alone are gigabytes), far too slow for CI. The
    image's base already holds Ray's own dependency tree; this checks what raycl adds."""
    match = re.search(r"-py(\d)(\d+)-", DOCKER.base)
    assert match, DOCKER.base
    image_python = (int(match[1]), int(match[2]))
    if sys.version_info[:2] != image_python or sys.platform != "linux" \
            or platform.machine() != "x86_64":
        pytest.skip(f"pip answers for this interpreter; the image is CPython "
                    f"{image_python[0]}.{image_python[1]} on linux x86_64")
    if isinstance(_index_versions("pip"), str):
        pytest.skip("the package index is unreachable from here")

    with zipfile.ZipFile(built_wheel) as wheel:
        metadata = next(wheel.read(n).decode() for n in wheel.namelist()
                        if n.endswith(".dist-info/METADATA"))
    (local,) = [r for r in DOCKER.requirements if _is_path(r)]
    extras = set(re.findall(r"\[(.*)\]", local)[0].split(",")) if "[" in local else set()
    environment = {k: str(v) for k, v in default_environment().items()}
    wanted: dict[str, SpecifierSet] = {}
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.partition(":")[2].strip())
        if req.marker and not any(req.marker.evaluate({**environment, "extra": e})
                                  for e in extras | {""}):
            continue
        name = canonicalize_name(req.name)
        wanted[name] = wanted.get(name, SpecifierSet()) & req.specifier
    for text in DOCKER.requirements:
        if not _is_path(text):
            req = Requirement(text)
            name = canonicalize_name(req.name)
            wanted[name] = wanted.get(name, SpecifierSet()) & req.specifier
    assert {"faiss-gpu", "ray", "torch", "boto3", "google-cloud-storage"} <= set(wanted)

    with ThreadPoolExecutor(max_workers=4) as pool:
        offered = dict(zip(wanted, pool.map(_index_versions, wanted), strict=True))
    unsatisfiable = {}
    for name, spec in wanted.items():
        versions = offered[name]
        if isinstance(versions, str):
            unsatisfiable[name] = f"{spec}: {versions}"
        elif not any(spec.contains(v, prereleases=False) for v in versions):
            unsatisfiable[name] = f"{spec}: none of the {len(versions)} versions offered"
    assert unsatisfiable == {}
