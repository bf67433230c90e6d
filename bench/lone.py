"""Lone requests to the archive `tsbatch archive --profile PROFILE` builds from checkout REPO, one
worker: the latency of a request sent alone after idle gaps, to compare two checkouts side by side.

    python bench/lone.py REPO PROFILE      (prints REPO and the latencies in ms)
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time


def main() -> None:
    repo, profile = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    sys.path.insert(0, repo)
    os.chdir(repo)
    import requests

    from tsbatch.archiver import server

    root = tempfile.mkdtemp(prefix="tsbatch-lone-")
    store = os.path.join(root, "store")
    ports = server.free_ports(5)
    subprocess.run([sys.executable, "-m", "tsbatch.archiver", "archive", "--name", "m", "--out", store, "--profile", profile,
                    "--inference-port", str(ports[0]), "--management-port", str(ports[1]),
                    "--metrics-port", str(ports[2]), "--grpc-inference-port", str(ports[3]),
                    "--grpc-management-port", str(ports[4])], check=True, stdout=subprocess.DEVNULL)
    paths = server.ServerPaths(os.path.join(root, "tmp"), os.path.join(root, "logs"))
    server.start(os.path.join(store, "config.properties"), store, paths)
    try:
        server.wait_ready(f"http://127.0.0.1:{ports[1]}", "m", 600)
        out = []
        for gap in (0.2, 1, 3, 0.5, 2, 0.2, 1, 1):
            time.sleep(gap)
            started = time.monotonic()
            requests.post(f"http://127.0.0.1:{ports[0]}/predictions/m", headers={"Content-Type": "text/plain"},
                          data=b"How do I scale TorchServe workers without losing requests?", timeout=30)
            out.append(round((time.monotonic() - started) * 1000, 1))
        print(repo, out)
    finally:
        server.stop(paths)


if __name__ == "__main__":
    main()
