"""Start, wait for and stop a TorchServe: shared by `make serve` and the end-to-end tests.

Readiness is every worker READY on the management API (TorchServe's /ping says Healthy while
workers are still loading). One torchserve per TMPDIR: its pid file lives there.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Iterator, Sequence


class ServerError(Exception):
    """TorchServe did not come up (or down) as asked; the message says where to look."""


@dataclass(frozen=True)
class ServerPaths:
    """Where one torchserve keeps its pid file (tmpdir) and its logs."""

    tmpdir: str
    logs: str

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        # TMPDIR holds the pid file; TEMP becomes the JVM's java.io.tmpdir, where the workers'
        # Unix sockets (.ts.sock.9000, ...) live: both must be private, or two servers collide.
        env.update(TMPDIR=self.tmpdir, TEMP=self.tmpdir, LOG_LOCATION=self.logs, METRICS_LOCATION=self.logs)
        bin_dir = os.path.dirname(sys.executable)
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
        return env


def torchserve_bin() -> str:
    local = os.path.join(os.path.dirname(sys.executable), "torchserve")
    return local if os.path.exists(local) else (shutil.which("torchserve") or "torchserve")


def start(properties: str, model_store: str, paths: ServerPaths, cwd: str | None = None,
          torchserve: str | None = None) -> None:
    """`torchserve --start` in the background, snapshots off, with this config and model store.
    `torchserve`: the script to run (default: this Python's); its Python runs the workers."""
    os.makedirs(paths.tmpdir, exist_ok=True)
    os.makedirs(paths.logs, exist_ok=True)
    cmd = [torchserve or torchserve_bin(), "--start", "--ncs", "--ts-config", properties, "--model-store", model_store]
    # The JVM inherits these descriptors and outlives this call: a file, never a pipe we wait on.
    out_path = os.path.join(paths.logs, "torchserve-start.log")
    with open(out_path, "ab") as out:
        code = subprocess.call(cmd, env=paths.env(), cwd=cwd or paths.tmpdir, stdout=out,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=120)
    if code != 0:
        with open(out_path, errors="replace") as f:
            raise ServerError(f"torchserve --start exited {code}: {f.read()[-2000:]}")


def stop(paths: ServerPaths, timeout: float = 60) -> bool:
    """`torchserve --stop` for the server whose pid file is in paths.tmpdir, and wait until its
    process has exited (so its ports are free again). False if none was running."""
    pid = running_pid(paths)
    if pid is None:
        return False
    subprocess.call([torchserve_bin(), "--stop"], env=paths.env(), cwd=paths.tmpdir,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout)
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def running_pid(paths: ServerPaths) -> int | None:
    """The pid of the torchserve recorded in paths.tmpdir, if that process is alive."""
    try:
        with open(os.path.join(paths.tmpdir, ".model_server.pid")) as f:
            pid = int(f.read().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def model_status(management_url: str, name: str) -> list[dict]:
    with urllib.request.urlopen(f"{management_url}/models/{name}", timeout=5) as response:
        return json.loads(response.read())


def workers(management_url: str, name: str) -> list[dict]:
    described = model_status(management_url, name)
    return [w for entry in described for w in entry.get("workers", [])]


def wait_ready(management_url: str, name: str, timeout: float, min_workers: int = 1,
               log_hint: str = "", max_workers: int | None = None) -> list[dict]:
    """Block until `name` has at least min_workers workers (and at most max_workers, as after a
    scale-down) and every one is READY."""
    deadline = time.monotonic() + timeout
    last = "no answer from the management API"
    while time.monotonic() < deadline:
        try:
            found = workers(management_url, name)
            states = [w.get("status") for w in found]
            counted = len(found) >= min_workers and (max_workers is None or len(found) <= max_workers)
            if counted and all(s == "READY" for s in states):
                return found
            last = f"workers {states}"
        except (urllib.error.URLError, OSError, ValueError) as error:
            last = str(error)
        time.sleep(0.5)
    raise ServerError(f"{name} not READY after {timeout:.0f}s ({last}){log_hint}")


# TorchServe 0.12's synchronous scale call (`PUT ...&synchronous=true`) waits for the new workers on
# the Netty event-loop thread that took the call (ApiUtils.updateModelWorkers ends in a blocking
# future.get()), and that thread also serves every inference connection Netty hands it: one in four
# with the default four threads of a 2-core machine. Those requests are not even read until every
# new worker has loaded and warmed (seen: 26 s of warmup, and in a CI run more than the clients'
# 120 s). So tsbatch scales asynchronously and polls the management API until the workers are READY.
SCALE_RETRY_MARKERS = ("ConcurrentModification", "Deque full")


def scale(management_url: str, name: str, workers: int, max_workers: int | None = None,
          timeout: float = 600, log_hint: str = "") -> list[dict]:
    """Scale `name` to `workers` workers (max_worker `max_workers`, default the same) without
    TorchServe's synchronous mode, then block until it has between the two (TorchServe keeps a
    count already in that range), all READY.
    TorchServe 0.12 answers some scale calls under load with 500 (ConcurrentModificationException in
    WorkLoadManager, or "Deque full" when the control command did not fit the model's queue):
    those are retried, as an operator would."""
    most = workers if max_workers is None else max_workers
    url = f"{management_url}/models/{name}?min_worker={workers}&max_worker={max(most, 1)}&synchronous=false"
    deadline = time.monotonic() + timeout
    for attempt in range(6):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="PUT"), timeout=60):
                break
        except urllib.error.HTTPError as error:
            body = error.read().decode(errors="replace")
            if error.code != 500 or attempt == 5 or not any(m in body for m in SCALE_RETRY_MARKERS):
                raise ServerError(f"scaling {name} to {workers} worker(s): HTTP {error.code} {body[:300]}") from error
        time.sleep(3)
    return wait_ready(management_url, name, max(1.0, deadline - time.monotonic()), workers, log_hint, most)


def free_ports(count: int) -> list[int]:
    """Loopback ports nobody listens on right now (bound together so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class Served:
    """A running torchserve: its addresses and where its pid file and logs are."""

    inference: str
    management: str
    metrics: str
    paths: ServerPaths
    store: str
    properties: str

    def log(self, name: str = "model_log.log") -> str:
        with open(os.path.join(self.paths.logs, name), errors="replace") as f:
            return f.read()


@contextlib.contextmanager
def local_server(root: str, store: str, models: Sequence[str], timeout: float = 600,
                 **settings: Any) -> Iterator[Served]:
    """A torchserve of its own: free loopback ports (HTTP and gRPC), a private TMPDIR under
    `root`, tsbatch's metrics config; waits until every model is READY and always stops it.
    Extra keyword arguments go to ServerSettings (e.g. max_request_size, tuned)."""
    from tsbatch.archiver.properties import ServerSettings, install_log_config, install_metrics_config, render_properties

    os.makedirs(root, exist_ok=True)
    ports = free_ports(5)
    config = ServerSettings(
        model_store=store, load_models=tuple(f"{m}.mar" for m in models),
        inference_port=ports[0], management_port=ports[1], metrics_port=ports[2],
        grpc_inference_port=ports[3], grpc_management_port=ports[4],
        metrics_config=install_metrics_config(store), log_config=install_log_config(store), **settings)
    properties = os.path.join(root, "config.properties")
    with open(properties, "w") as f:
        f.write(render_properties(config))
    paths = ServerPaths(os.path.join(root, "tmp"), os.path.join(root, "logs"))
    served = Served(f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}",
                    f"http://127.0.0.1:{ports[2]}", paths, store, properties)
    start(properties, store, paths)
    try:
        for model in models:
            wait_ready(served.management, model, timeout, log_hint=f"; see {paths.logs}")
        yield served
    finally:
        stop(paths)


def stop_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so `finally` blocks (and local_server) stop their torchserve."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
