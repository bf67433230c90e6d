"""Async mode (`asyncCommunication: true`): TorchServe hands each request to its own coroutine as
it arrives, and the coroutine awaits the request's answer from tsbatch's lanes. TorchServe 0.12
cannot restart an async worker that died (see the README), so it is opt-in.
"""
from __future__ import annotations

import asyncio
import time

from tsbatch.handlers.edge.modes.scheduled import ScheduledMode
from tsbatch.handlers.edge.stages import Call, answer, by_request, is_http, prepare, request_headers


class AsyncMode(ScheduledMode):
    name = "async"

    async def handle(self, data: list, context) -> list:
        """Never raises (one raise fails every request in flight on the worker)."""
        w = self.worker
        arrived = time.monotonic()  # the deadline counts from here: parsing and tokenizing are inside it
        call = Call.of(len(data))
        try:
            waiting = []
            for request in by_request(prepare(w.model, w.edges, w.unfit, data, context, call, limits=w.config)):
                reply = self.admit(request, context, arrived, call)
                if reply is not None:
                    waiting.append((request[0].index, asyncio.wrap_future(reply.future)))
            for index, future in waiting:
                call.settle(index, await future)
        except Exception as error:  # noqa: BLE001
            call.fail_unanswered(error)
        return _reply(answer(call, context), call, context)


def _reply(bodies: list, call: Call, context) -> list:
    """Send the answers of an async-mode call so that TorchServe 0.12's frontend forgets each job,
    and return the final replies' bodies.

    Its async frontend drops a job only on a reply marked ts_stream_next=false, and a streamed
    reply with a status >= 400 loses its body. So over HTTP: results go out as one streamed chunk
    (200) whose final reply is empty; errors go out as plain full responses (status and JSON body;
    the frontend closes that connection), and their final reply carries ts_stream_next=false
    explicitly so the frontend forgets them too. Over gRPC the frontend completes a Predictions
    call at its first reply and kills the worker at a second, so a gRPC request's answer is its
    one final reply, marked ts_stream_next=false.
    """
    from ts.handler_utils.utils import send_intermediate_predict_response
    from ts.protocol.otf_message_handler import create_predict_response

    ids = context.request_ids
    grpc = {i for i in ids if not is_http(request_headers(context, i))}
    ok = {i: rid for i, rid in ids.items() if i not in grpc and not call.answers[i].failed}
    failed = {i: rid for i, rid in ids.items() if i not in grpc and i not in ok}
    if ok:
        send_intermediate_predict_response(bodies, ok, "tsbatch", 200, context)
    if failed:
        context.cl_socket.sendall(create_predict_response(bodies, failed, "tsbatch", 200, context))
        for index in failed:
            context.set_response_header(index, "ts_stream_next", "false")
    for index in grpc:
        context.set_response_header(index, "ts_stream_next", "false")
    return [bodies[i] if i in grpc else "" for i in range(len(bodies))]
