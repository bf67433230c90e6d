"""How one generation answer goes back through TorchServe 0.12's async frontend, over HTTP or gRPC.

HTTP: every piece (a whole answer, or one line of a stream) is an intermediate reply, and the final
reply handle() returns is empty: the frontend forgets the job only on a reply marked
ts_stream_next=false that follows a "true" one (a plain reply would stay on its heap). An error
before any piece is a full reply with its own status; after one, the status is fixed at 200 and
the error is the stream's last line.
gRPC: the frontend completes a Predictions call at its first reply and kills the async worker at a
second one ("Stream is already completed", the worker is not restarted), and the backend cannot
tell Predictions from StreamPredictions (neither sends headers). So every gRPC answer is one reply,
the final one, marked ts_stream_next=false: a stream's lines arrive together, an error as its JSON
body (gRPC drops the status).
"""
from __future__ import annotations

import json
import os
from http import HTTPStatus

from tsbatch.handlers.errors import Overloaded, ServingError

JSON = "application/json"
NDJSON = "application/x-ndjson"
WORKER_HEADER = "x-tsbatch-worker"  # as the encoder modes write it: pid of the worker that answered
STREAM_NEXT = "ts_stream_next"


class Reply:
    """One request's way back: `piece` for each part of its answer, `fail` for its error, and
    `final()` for the body handle() returns for it."""

    def __init__(self, index: int, context, http: bool):
        self.index, self.context, self.http = index, context, http
        self.pieces = 0  # pieces that left (HTTP) or were kept for the final reply (gRPC)
        self.kept: list[str] = []
        context.set_response_header(index, WORKER_HEADER, str(os.getpid()))

    def piece(self, body: str, content_type: str) -> None:
        self.pieces += 1
        self.context.set_response_content_type(self.index, content_type)
        if not self.http:
            self.kept.append(body)
            return
        from ts.handler_utils.utils import send_intermediate_predict_response

        send_intermediate_predict_response({self.index: body}, {self.index: self._rid()}, "tsbatch", 200, self.context)

    def fail(self, error: ServingError) -> None:
        """The request's error: its own status if nothing left yet, else the last line of its stream."""
        body = json.dumps(error.to_body())
        if self.pieces:
            self.piece(body + "\n", NDJSON)
            return
        if not self.http:
            self.kept = [body]
            self.context.set_response_content_type(self.index, JSON)
            return
        from ts.protocol.otf_message_handler import create_predict_response

        self.context.set_response_content_type(self.index, JSON)
        self.context.set_response_status(error.status, HTTPStatus(error.status).phrase, idx=self.index)
        if isinstance(error, Overloaded):
            self.context.set_response_header(self.index, "Retry-After", "1")
        self.context.cl_socket.sendall(create_predict_response({self.index: body}, {self.index: self._rid()},
                                                               "tsbatch", 200, self.context))
        self.context.set_response_header(self.index, STREAM_NEXT, "false")  # so the empty final reply ends the job

    def final(self) -> str:
        if self.http:
            return ""  # the answer went out already
        self.context.set_response_header(self.index, STREAM_NEXT, "false")
        return "".join(self.kept)

    def _rid(self) -> str:
        return self.context.request_ids[self.index]
