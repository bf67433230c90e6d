"""A small HTTP client for the tests: concurrent posts released together by a barrier."""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import requests


@dataclass
class Answer:
    status: int
    body: Any
    headers: dict


def post(url: str, payload: Any, content_type: str = "text/plain", timeout: float = 60) -> Answer:
    data = json.dumps(payload).encode() if content_type == "application/json" and not isinstance(payload, (bytes, str)) else payload
    if isinstance(data, str):
        data = data.encode("utf-8")
    response = requests.post(url, data=data, headers={"Content-Type": content_type}, timeout=timeout)
    try:
        body = response.json()
    except ValueError:
        body = response.text
    return Answer(response.status_code, body, dict(response.headers))


def post_together(url: str, payloads: Sequence[Any], timeout: float = 60) -> list[Answer]:
    """Send every payload at the same moment from its own thread; answers in payload order.

    A payload is text (sent as text/plain) or a (body, content type) tuple.
    """
    barrier = threading.Barrier(len(payloads))
    answers: list[Any] = [None] * len(payloads)

    def send(i: int, payload: Any) -> None:
        body, ct = payload if isinstance(payload, tuple) else (payload, "text/plain")
        barrier.wait()
        try:
            answers[i] = post(url, body, ct, timeout)
        except Exception as error:  # noqa: BLE001 - recorded, then failed on by the test
            answers[i] = error

    threads = [threading.Thread(target=send, args=(i, p)) for i, p in enumerate(payloads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    for answer in answers:
        if not isinstance(answer, Answer):
            raise AssertionError(f"a request got no answer: {answer!r}")
    return answers


class GrpcInference:
    """A Predictions stub built from inference.proto as TorchServe publishes it (in its jar), on a
    served archive's gRPC inference port (read from its config.properties)."""

    def __init__(self, properties: str, model: str, build_dir: str):
        import os
        import sys
        import zipfile

        import grpc
        import grpc_tools
        import ts
        from grpc_tools import protoc

        with zipfile.ZipFile(os.path.join(os.path.dirname(ts.__file__), "frontend", "model-server.jar")) as jar:
            for name in ("inference.proto", "google/rpc/status.proto"):
                jar.extract(name, build_dir)
        well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
        assert protoc.main(["protoc", f"-I{build_dir}", f"-I{well_known}", f"--python_out={build_dir}",
                            f"--grpc_python_out={build_dir}", "inference.proto", "google/rpc/status.proto"]) == 0
        sys.path.insert(0, build_dir)
        try:
            import inference_pb2
            import inference_pb2_grpc
        finally:
            sys.path.remove(build_dir)
        with open(properties) as f:
            port = next(line.split("=", 1)[1].strip() for line in f if line.startswith("grpc_inference_port="))
        self.messages, self.model = inference_pb2, model
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = inference_pb2_grpc.InferenceAPIsServiceStub(self.channel)

    def predict(self, data: bytes, timeout: float = 60):
        request = self.messages.PredictionsRequest(model_name=self.model, input={"data": data})
        return json.loads(self.stub.Predictions(request, timeout=timeout).prediction)

    def stream(self, data: bytes, timeout: float = 60) -> list[bytes]:
        """StreamPredictions: every message's prediction, in order."""
        request = self.messages.PredictionsRequest(model_name=self.model, input={"data": data})
        return [reply.prediction for reply in self.stub.StreamPredictions(request, timeout=timeout)]

    def close(self) -> None:
        self.channel.close()
