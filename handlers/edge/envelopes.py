"""The request shapes that carry several texts, and the response shape each one expects back.

- a list: JSON `{"text": [...]}`, or `inputs` (TEI) / `input` (OpenAI): a JSON list of results
- KServe v1: `{"instances": [...]}` (each a text or an object with a text field): `{"predictions": [...]}`
- KServe v2 / Open Inference Protocol: `{"inputs": [{"name", "shape", "datatype": "BYTES", "data":
  [...]}]}`: `{"model_name", "outputs": [{"name", "shape", "datatype", "data"}]}`, one output
  tensor per result field, rows in input order

tsbatch reads these itself instead of through TorchServe's KServe envelopes, which answer only the
first request of a frontend batch (and of a v2 BYTES tensor, only its first text): each text is
bucketed and batched on its own, with other requests' texts. Pure: no torch, no TorchServe.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from tsbatch.handlers.core.errors import BadInput

LIST, KSERVE_V1, KSERVE_V2 = "list", "kserve_v1", "kserve_v2"
TEXT_KEYS = ("text", "inputs", "input")  # ours, TEI's and the Open Inference Protocol's, OpenAI's


def unwrap(value: Mapping) -> tuple[list, str] | None:
    """(one body per text, the envelope) of a request of several texts, or None for one text.
    Each body is `{"text": t}` plus the request's other fields, so they hold for every text (a
    generation's max_new_tokens); a KServe v1 instance that is an object is its own body."""
    if isinstance(value.get("instances"), list):
        instances = value["instances"]
        if not instances:
            raise BadInput('"instances" is an empty list: send at least one text')
        return [dict(i) if isinstance(i, Mapping) else {"text": i} for i in instances], KSERVE_V1
    key = next((k for k in TEXT_KEYS if k in value), None)
    if key is None or not isinstance(value[key], list):
        return None
    texts, envelope = value[key], LIST
    if texts and all(isinstance(t, Mapping) for t in texts):
        texts, envelope = _tensor_texts(texts), KSERVE_V2
    if not texts:
        raise BadInput(f'"{key}" is an empty list: send at least one text')
    rest = {k: v for k, v in value.items() if k != key}
    return [{**rest, "text": text} for text in texts], envelope


def _tensor_texts(tensors: list) -> list:
    """The texts of Open Inference Protocol inputs: one BYTES tensor whose data are the texts."""
    if len(tensors) != 1:
        raise BadInput(f"send one input tensor of texts, got {len(tensors)}")
    tensor = tensors[0]
    if str(tensor.get("datatype", "BYTES")).upper() != "BYTES":
        raise BadInput(f'the input tensor\'s datatype must be BYTES (texts), got {tensor.get("datatype")!r}')
    data = tensor.get("data")
    if not isinstance(data, list):
        raise BadInput('the input tensor has no "data" list of texts')
    return data


def wrap(envelope: str, results: list, model_name: str = "") -> Any:
    """A request's results (one per text, in order) in the shape its envelope expects."""
    if envelope == KSERVE_V1:
        return {"predictions": results}
    if envelope == KSERVE_V2:
        fields = list(results[0]) if results and isinstance(results[0], Mapping) else []
        outputs = [_tensor(name, [r.get(name) for r in results]) for name in fields] if fields else \
            [_tensor("output", results)]
        return {"model_name": model_name, "outputs": outputs}
    return results


def _tensor(name: str, values: Sequence) -> dict:
    """One output tensor: numbers as FP32/INT64 of shape [n] (or [n, d] for equal-length vectors);
    anything else as BYTES, one JSON text (or string) per row."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if values and all(isinstance(v, list) and v and all(number(x) for x in v) for v in values) \
            and len({len(v) for v in values}) == 1:
        flat = [x for v in values for x in v]
        return {"name": name, "shape": [len(values), len(values[0])], "datatype": _numeric(flat), "data": flat}
    if values and all(number(v) for v in values):
        return {"name": name, "shape": [len(values)], "datatype": _numeric(values), "data": list(values)}
    data = [v if isinstance(v, str) else json.dumps(v) for v in values]
    return {"name": name, "shape": [len(values)], "datatype": "BYTES", "data": data}


def _numeric(values: Sequence) -> str:
    return "INT64" if all(isinstance(v, int) for v in values) else "FP32"
