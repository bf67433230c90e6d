"""A real torchserve (Java frontend + Python workers) on loopback ports, in its own TMPDIR.

One server per test session serves the test models; it is always stopped, even when a test fails.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

import pytest

from tsbatch.archiver import server
from tsbatch.archiver.package import ArchiveSpec, build_archive
from tsbatch.archiver.properties import model_config
from tsbatch.archiver.tune import frontend_keys

# A long delay makes concurrent requests meet in one frontend batch; a full batch leaves at once.
TEST_FRONTEND = {"batchSize": 8, "maxBatchDelay": 500, "minWorkers": 1, "maxWorkers": 2, **frontend_keys("default")}
# tsbatch's own scheduler, as shipped: the frontend hands the worker every request it holds plus
# new ones on each call (continuous batching), tsbatch batches and answers the finished ones.
CONTINUOUS_FRONTEND = {"minWorkers": 1, "maxWorkers": 1, **frontend_keys("continuous")}
# tsbatch's own scheduler in async mode: the frontend hands over each request at once.
ASYNC_FRONTEND = {"minWorkers": 1, "maxWorkers": 1, **frontend_keys("async")}
MODELS = {
    # name -> (handler section, frontend keys); the POISON seam fails a pass, SLOW keeps one busy 3 s
    # a few buckets keep warmup short in tests; the shipped default has 16
    "minilm": ({"task": "embedding", "fault_injection": {"substring": "POISON", "slow_substring": "SLOW"},
                "max_batch_size": 8,
                "buckets": [16, 64, 256]}, TEST_FRONTEND),
    "minilm_oom": ({"task": "embedding", "fault_injection": {"oom_above_batch": 2}, "warmup": False},
                   TEST_FRONTEND),
    "minilm_async": ({"task": "embedding", "fault_injection": {"substring": "POISON", "slow_substring": "SLOW"},
                      "warmup": False,
                      "max_wait_ms": 20, "queue_cap": 64}, ASYNC_FRONTEND),
    "minilm_cont": ({"task": "embedding", "fault_injection": {"substring": "POISON", "slow_substring": "SLOW"},
                     "max_batch_size": 8,
                     "buckets": [16, 64, 256], "max_wait_ms": 20, "queue_cap": 64}, CONTINUOUS_FRONTEND),
}


@pytest.fixture(scope="session")
def torchserve(tmp_path_factory, minilm_dir):
    root = tmp_path_factory.mktemp("torchserve")
    store = str(root / "model_store")
    for name, (handler, frontend) in MODELS.items():
        build_archive(ArchiveSpec(minilm_dir, name, model_config(handler, frontend), store))
    with server.local_server(str(root), store, list(MODELS), timeout=300) as served:
        yield served


# -- the archive exactly as `tsbatch archive` builds it -------------------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = "minilm"


def tsbatch(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "tsbatch.archiver", *args], check=True, cwd=REPO, timeout=900,
                   stdout=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def wheel_venv(tmp_path_factory) -> str:
    """tsbatch as a team installs it: the wheel `pip wheel` builds from this checkout, installed
    (not editable) into a fresh venv. Its dependencies come from the test venv through a .pth
    file (a copy of torch and TorchServe would take minutes), and its own `torchserve` script runs
    the workers on the venv's Python. `make test-wheel` (CI) passes a venv where the wheel and its
    dependencies were installed for real, from the package index, in TSBATCH_WHEEL_VENV."""
    given = os.environ.get("TSBATCH_WHEEL_VENV")
    if given:
        assert os.path.exists(os.path.join(given, "bin", "tsbatch")), f"no tsbatch CLI in {given}"
        return given
    root = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(root / "dist"), REPO], check=True, timeout=300, capture_output=True)
    [wheel] = [str(p) for p in (root / "dist").iterdir() if p.name.endswith(".whl")]
    venv = str(root / "venv")
    subprocess.run([_base_python(), "-m", "venv", venv], check=True, timeout=300)
    python = os.path.join(venv, "bin", "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], check=True, timeout=300)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    deps = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "_tsbatch_test_deps.pth"), "w") as f:
        f.write(deps + "\n")
    script = os.path.join(venv, "bin", "torchserve")
    with open(script, "w") as f:
        f.write(f"#!{python}\nfrom ts.model_server import start\nstart()\n")
    os.chmod(script, 0o755)
    return venv


@contextlib.contextmanager
def serve_example(root, venv: str, example: str, name: str, make_args: list[str], archive_args: list[str],
                  handler_yaml: str):
    """An example as a team runs it: the folder copied to the team's own place (root/team), its
    model made there, archived by the venv's `tsbatch archive` with handler.yaml (profiled and
    tuned here), served by the venv's torchserve on free ports, READY; always stopped."""
    team = root / "team"
    shutil.copytree(example, team, ignore=shutil.ignore_patterns("__pycache__"))
    python, cli = (os.path.join(venv, "bin", tool) for tool in ("python", "tsbatch"))
    model_dir = str(root / "model")
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([python, "make_model.py", model_dir, *make_args], cwd=team, check=True, timeout=300,
                   stdout=subprocess.DEVNULL, env=clean)
    (team / "handler.yaml").write_text(handler_yaml)
    ports = server.free_ports(5)
    store = str(root / "store")
    subprocess.run([cli, "archive", *archive_args, "--model-dir", model_dir, "--name", name,
                    "--handler-config", "handler.yaml", "--out", store,
                    "--inference-port", str(ports[0]), "--management-port", str(ports[1]),
                    "--metrics-port", str(ports[2]), "--grpc-inference-port", str(ports[3]),
                    "--grpc-management-port", str(ports[4])], cwd=team, check=True, timeout=900,
                   stdout=subprocess.DEVNULL, env=clean)
    paths = server.ServerPaths(str(root / "tmp"), str(root / "logs"))
    served = server.Served(f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}",
                           f"http://127.0.0.1:{ports[2]}", paths, store, os.path.join(store, "config.properties"))
    server.start(served.properties, store, paths, torchserve=os.path.join(venv, "bin", "torchserve"))
    try:
        server.wait_ready(served.management, name, 600)
        yield served
    finally:
        server.stop(paths)


def _base_python() -> str:
    """The interpreter this test venv was made from (a venv made from a venv would share its packages' path)."""
    return os.path.join(sys.base_prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")


@pytest.fixture(scope="session")
def built_profile(tmp_path_factory) -> str:
    """`tsbatch profile` of the default model on this machine, taken once: each built archive
    below is `tsbatch archive --profile` of it, which is what `make archive` runs minus profiling."""
    path = str(tmp_path_factory.mktemp("profile") / "profile.json")
    tsbatch("profile", "--name", NAME, "--out", path)
    return path


def serve_built(root, profile: str, *extra: str) -> server.Served:
    """`tsbatch archive` into root/store on free ports, then torchserve with the config.properties
    and model-config.yaml it wrote (not waited for: the caller waits for what it expects)."""
    return serve_archived(root, "--name", NAME, "--profile", profile, *extra)


def serve_archived(root, *args: str) -> server.Served:
    """`tsbatch archive ARGS` into root/store on free ports, then torchserve as serve_built starts it."""
    ports = server.free_ports(5)
    store = str(root / "store")
    tsbatch("archive", "--out", store, *args,
            "--inference-port", str(ports[0]), "--management-port", str(ports[1]), "--metrics-port", str(ports[2]),
            "--grpc-inference-port", str(ports[3]), "--grpc-management-port", str(ports[4]))
    paths = server.ServerPaths(str(root / "tmp"), str(root / "logs"))
    properties = os.path.join(store, "config.properties")
    served = server.Served(f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}",
                           f"http://127.0.0.1:{ports[2]}", paths, store, properties)
    server.start(properties, store, paths)
    return served


@pytest.fixture(scope="module")
def shipped(tmp_path_factory, built_profile) -> server.Served:
    """The archive as `make archive` builds it on this 2-core machine (1 worker), served as
    built; one per test module, so a module that scales it leaves the others alone."""
    served = serve_built(tmp_path_factory.mktemp("shipped"), built_profile)
    try:
        server.wait_ready(served.management, NAME, 600)
        yield served
    finally:
        server.stop(served.paths)
