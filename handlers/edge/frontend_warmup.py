"""A few requests through TorchServe's frontend as the worker goes READY (`handler.frontend_warmup`).

Warmup runs every shape inside the worker, but the frontend's own code for an inference request
(its HTTP intake, the job, the reply and its metrics) first runs for the first client: about 5 ms
more here, half again a short request's whole time. Sent from initialize(), these requests wait in
the frontend's queue until a worker is READY and are then most likely its first jobs; every client
after them finds the frontend warm. They are served as any request (a pass of the smallest bucket:
the handler's own first-request paths warm too) and counted in the metrics, REQUESTS per worker start.
"""
from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.parse
import urllib.request

logger = logging.getLogger(__name__)

BODY = json.dumps({"text": "tsbatch warmup"}).encode()
REQUESTS = 3  # one after another: the first pays most, the next two what a second request still did here
TIMEOUT_S = 120.0  # it waits in the frontend's queue while this worker finishes loading


def send(address: str, model_name: str, timeout: float = TIMEOUT_S) -> threading.Thread:
    """POST BODY to `address`/predictions/`model_name`, REQUESTS times from a daemon thread, and
    log the answers (a team's model that cannot take the text answers 400: warm all the same)."""
    url = f"{address}/predictions/{urllib.parse.quote(model_name, safe='')}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy

    def run() -> None:
        statuses = []
        for _ in range(REQUESTS):
            request = urllib.request.Request(url, data=BODY, headers={"Content-Type": "application/json"})
            try:
                with opener.open(request, timeout=timeout) as response:
                    statuses.append(response.status)
                    response.read()
            except urllib.error.HTTPError as error:
                statuses.append(error.code)
            except (OSError, ValueError) as error:
                logger.warning("tsbatch frontend warmup: no answer from %s (%s); the first client's request pays "
                               "the frontend's first-request costs", url, error)
                return
        logger.info("tsbatch frontend warmup: %s answered %s", url, statuses)

    thread = threading.Thread(target=run, name="tsbatch-frontend-warmup", daemon=True)
    thread.start()
    return thread
