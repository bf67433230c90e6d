"""tsbatch's built-in TorchServe handler for text generation (`task: generation`): any local
causal-LM directory with safetensors weights, scheduled token by token.

Before the worker is READY, initialize() warms every prefill shape and decode batch size the
engine can form (handlers/runtime/generation_warming.py) and keeps the timings as `profile`
(generation_profile.json in the model directory), unless `handler.warmup` is false.

It runs in TorchServe's async mode (`asyncCommunication: true`): each request is a coroutine that
submits to the worker's one GenerationEngine (handlers/runtime/generation_engine.py) and awaits its
tokens; a streamed request gets one line per token. The request and answer shapes and the settings
are handlers/edge/generation_api.py's.

Reply, at the end, is how one answer goes back through TorchServe 0.12's async frontend, over
HTTP or gRPC.

A client that disconnects: TorchServe 0.12 does not tell an async worker (handlers/edge/client_watch.py
says what its sources show), so each request remembers the frontend's client connections open when it
arrived and, while it waits for tokens, looks every CHECK_EVERY seconds whether any is still open;
once none is, its sequence is cancelled (the seat is free at the next step) and the frontend's job is
ended with a final reply nobody reads.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from http import HTTPStatus

from tsbatch.handlers.core.errors import BadInput, InputTooLong, ModelFailed, Overloaded, ServingError
from tsbatch.handlers.core.generation_policy import GenerationRequest, GenerationPolicy, Status
from tsbatch.handlers.edge import backend_socket, call_lines
from tsbatch.handlers.edge.client_watch import ClientWatch
from tsbatch.handlers.edge.generation_api import (GenerationConfig, TextStream, answer_body, deadline_of, kv_bound_for,
                                                  line, parse_ask, priority_of)
from tsbatch.handlers.edge.metrics import Metrics
from tsbatch.handlers.edge.stages import is_http
from tsbatch.warmup.generation_profile import prefill_edges

logger = logging.getLogger(__name__)

TIMING_HEADER = "x-tsbatch-timing"  # the encoder modes' header, with generation's own parts
JSON = "application/json"
NDJSON = "application/x-ndjson"
WORKER_HEADER = "x-tsbatch-worker"  # as the encoder modes write it: pid of the worker that answered
STREAM_NEXT = "ts_stream_next"
CHECK_EVERY = 0.25  # seconds between looks at whether a waiting request's client is still connected


class ClientGone(ServingError):
    """The client disconnected: its answer ends the frontend's job; nobody reads it."""

    status = 408


class GenerationHandler:
    """Serves one causal LM; configured by the `handler:` section of model-config.yaml."""

    def __init__(self):
        self.initialized = False
        self.config: GenerationConfig | None = None
        self.runner = None
        self.engine = None
        self.profile = None  # the GenerationProfile warmup measured (None with warmup off)
        self.watch = ClientWatch(None)

    def initialize(self, context) -> None:
        import torch

        from tsbatch.handlers.models.generation_runner import GenerationRunner
        from tsbatch.handlers.models.threads import use_intra_op_threads
        from tsbatch.handlers.runtime.generation_engine import GenerationEngine

        started = time.monotonic()
        backend_socket.lock_writes()  # intermediate and final replies are written from two threads
        backend_socket.buffer_reads()  # TorchServe reads each field of a call with its own recv
        call_lines.quiet_calls(getattr(context, "metrics", None))  # and prints two lines per call
        yaml_config = context.model_yaml_config or {}
        self.config = config = GenerationConfig.from_section(yaml_config.get("handler"))
        if config.torch_threads:
            use_intra_op_threads(config.torch_threads)
        gpu_id = context.system_properties.get("gpu_id")
        on_gpu = config.device == "auto" and str(gpu_id).isdigit() and torch.cuda.is_available()
        device = f"cuda:{gpu_id}" if on_gpu else "cpu"
        model_dir = os.path.join(context.system_properties.get("model_dir"), config.model_dir)
        self.runner = GenerationRunner(model_dir, device)
        device_bound = None  # on the CPU nothing says how much memory is ours: kv_bound as configured
        if on_gpu:
            free, _total = torch.cuda.mem_get_info(self.runner.device)
            device_bound = kv_bound_for(free, self.runner.kv_bytes_per_token, config.kv_memory_share)
        settings = config.settings(device_bound, prefill_edges(self.runner.max_positions))
        if config.warmup:  # before the engine serves: every shape it forms is warm by READY
            from tsbatch.handlers.runtime.generation_warming import warm_up_generation

            self.profile, settings = warm_up_generation(
                self.runner, settings, config.warmup_repeats, config.warmup_max_repeats, context.model_name,
                context.system_properties.get("model_dir"), yaml_config.get("startupTimeout", 120),
                torch.get_num_threads())
        metrics = Metrics(getattr(context, "metrics", None), context.model_name)
        metrics.generation_budget(settings.token_budget)
        self.engine = GenerationEngine(GenerationPolicy(settings), self.runner, metrics=metrics).start()
        self.watch = ClientWatch.of_frontend()
        if config.fault_oom_substring is not None:
            logger.warning("fault injection is ON: a request whose text contains %r runs out of memory once",
                           config.fault_oom_substring)
        logger.info("tsbatch generation loaded %s on %s: token_budget=%d kv_bound=%d (%d bytes a token) "
                    "max_running=%d in %.1fs (warmup %s)", type(self.runner.lm).__name__, device, settings.token_budget,
                    settings.kv_bound, self.runner.kv_bytes_per_token, settings.max_running, time.monotonic() - started,
                    f"{self.profile.warmup_seconds:.1f}s" if self.profile else "off")
        self.initialized = True

    async def handle(self, data: list, context) -> list:
        """Never raises: one raise in async mode fails every request in flight on the worker."""
        return list(await asyncio.gather(*(self._serve(index, row, context) for index, row in enumerate(data))))

    def close(self) -> None:
        """Stop the engine's thread (tests; TorchServe ends a worker by ending its process)."""
        if self.engine is not None:
            self.engine.stop()
            self.engine = None

    async def _serve(self, index: int, row, context) -> str:
        """Answer one request; returns its body for the final reply (Reply.final)."""
        headers = _headers(context, index)
        reply = Reply(index, context, is_http(headers))
        try:
            seq, waiter, ask = self._submit(index, row, headers, context)
        except ServingError as error:
            reply.fail(error)
            return reply.final()
        except Exception as error:  # noqa: BLE001 - a bug on one request answers that request alone
            logger.exception("tsbatch generation: request %s", context.request_ids.get(index))
            reply.fail(ModelFailed(f"the handler failed on this request: {type(error).__name__}"))
            return reply.final()
        # the connections open on arrival, looked at on another thread: a look is a few ms of system calls
        # this request's first token need not wait behind (nor any other request's tokens)
        seen = asyncio.ensure_future(asyncio.to_thread(self.watch.open_now, seq.request.arrived))
        try:
            await (self._stream if ask.stream else self._whole)(seq, _Events(waiter, self.watch, seen), reply)
        except ClientGone as gone:
            if self.engine.cancel(seq):
                logger.info("tsbatch generation: the client of %s went away after %d tokens: its seat is free",
                            seq.rid, len(seq.tokens))
            if not reply.pieces:
                reply.fail(gone)  # ends the frontend's job, which a plain empty reply would not
        except Exception:  # noqa: BLE001 - e.g. the event loop closing: free the seat, never raise
            logger.exception("tsbatch generation: answering %s", seq.rid)
            self.engine.cancel(seq)
        return reply.final()

    def _submit(self, index: int, row, headers: dict, context):
        from tsbatch.handlers.runtime.generation_engine import AsyncWaiter

        now = time.monotonic()
        ask = parse_ask(row.get("body", row.get("data")) if isinstance(row, dict) else row, self.config)
        priority, deadline = priority_of(headers), deadline_of(headers, self.config, now)
        prompt = self.runner.encode(ask.text)
        if not prompt:
            raise BadInput("the text has no tokens")
        if len(prompt) + ask.max_new_tokens > self.runner.max_positions:
            raise InputTooLong(f"a prompt of {len(prompt)} tokens and max_new_tokens {ask.max_new_tokens} are more "
                               f"than the model's {self.runner.max_positions} positions: shorten one")
        waiter = AsyncWaiter(asyncio.get_running_loop())
        rid = str(context.request_ids.get(index, index))
        fault = self.config.fault_oom_substring
        seq = self.engine.submit(GenerationRequest(rid, tuple(prompt), ask.max_new_tokens, now, priority, deadline), waiter,
                                 fault_oom=fault is not None and fault in ask.text)
        return seq, waiter, ask

    async def _whole(self, seq, waiter, reply: Reply) -> None:
        while (await waiter.next())[0] != "end":
            pass
        _timing(reply, seq)
        if seq.status is not Status.FINISHED:
            reply.fail(seq.error or ModelFailed("the request ended without an answer"))
            return
        reply.piece(json.dumps(answer_body(self.runner.decode_text(seq.tokens), len(seq.tokens), seq.stop)), JSON)

    async def _stream(self, seq, waiter, reply: Reply) -> None:
        text = TextStream(self.runner.decode_text)
        while True:
            kind, value = await waiter.next()
            if not reply.pieces:  # the first reply fixes the headers: the time to the first token is what they can say
                _timing(reply, seq)
            if kind == "token":
                reply.piece(line({"token": value, "text": text.add(value)}), NDJSON)
                continue
            if seq.status is Status.FINISHED:
                reply.piece(line(answer_body(self.runner.decode_text(seq.tokens), len(seq.tokens), seq.stop)), NDJSON)
            else:
                reply.fail(seq.error or ModelFailed("the request ended without an answer"))
            return


class _Events:
    """A request's waiter, looked through: its next event, or ClientGone once its client is (looked
    at every CHECK_EVERY seconds, whether tokens come fast or not at all, on another thread than the
    event loop's). `seen`: the future of the connections open on arrival; until it is done, or if
    it failed, the client is never gone (the rule errs late)."""

    def __init__(self, waiter, watch: ClientWatch, seen: asyncio.Future):
        self.waiter, self.watch, self.seen = waiter, watch, seen
        self.looked = time.monotonic()

    async def next(self):
        while True:
            event = await self.waiter.next_event(CHECK_EVERY)
            now = time.monotonic()
            if now - self.looked >= CHECK_EVERY:
                self.looked = now
                if await self._gone():
                    raise ClientGone("the client disconnected")
            if event is not None:
                return event

    async def _gone(self) -> bool:
        if not self.seen.done() or self.seen.cancelled() or self.seen.exception() is not None:
            return False
        return await asyncio.to_thread(self.watch.gone, self.seen.result())


def _headers(context, index: int) -> dict:
    """The request's headers with lower-cased names."""
    try:
        headers = context.get_all_request_header(index) or {}
    except Exception:  # noqa: BLE001 - a context without headers means none
        return {}
    return {str(k).lower(): v for k, v in headers.items()}


def _timing(reply: Reply, seq) -> None:
    """x-tsbatch-timing: ms from arrival to the first token and to the end, as far as known."""
    arrived = seq.request.arrived
    parts = [f"{name}={(at - arrived) * 1000:.1f}" for name, at in
             (("first_token", seq.first_token_at), ("total", seq.ended_at)) if at is not None]
    if seq.preemptions:
        parts.append(f"preempted={seq.preemptions}")
    if parts:
        reply.context.set_response_header(reply.index, TIMING_HEADER, "; ".join(parts))


class Reply:
    """One request's way back: `piece` for each part of its answer, `fail` for its error, and
    `final()` for the body handle() returns for it.

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
