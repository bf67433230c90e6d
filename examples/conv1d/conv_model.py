"""A plain PyTorch model served with tsbatch: a 1-D convolutional net over variable-length signals.

Not from Hugging Face: a `torch.nn.Module` whose weights are a safetensors file and whose shape is
a small config.json, both in the model directory (`make_model.py` writes a random one). Requests
are JSON {"values": [floats]}; the length tsbatch buckets by is the number of values. The answer
is the signal's class scores, computed over the real values only (padding is masked out), so a
request gets the same answer whatever it is batched with.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

from tsbatch.handlers.api import BadInput, Batch, Model, Request
from tsbatch.handlers.models.threads import use_intra_op_threads


class ConvNet(torch.nn.Module):
    def __init__(self, channels: int, classes: int):
        super().__init__()
        self.conv1 = torch.nn.Conv1d(1, channels, kernel_size=5, padding=2)
        self.conv2 = torch.nn.Conv1d(channels, channels, kernel_size=5, padding=2)
        self.head = torch.nn.Linear(channels, classes)

    def forward(self, signal: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """signal, mask: (batch, length); padding positions have mask 0 and never reach the pool."""
        x = torch.relu(self.conv1(signal.unsqueeze(1))) * mask.unsqueeze(1)
        x = torch.relu(self.conv2(x)) * mask.unsqueeze(1)
        pooled = x.sum(dim=2) / mask.sum(dim=1, keepdim=True).clamp(min=1)
        return self.head(pooled)


class ConvModel(Model):
    """The tsbatch Model for ConvNet: prepare, forward, example."""

    def __init__(self, model_dir: str, device: str = "cpu"):
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        self.max_length = int(config["max_length"])
        self.labels = list(config["labels"])
        self.device = torch.device(device)
        self.net = ConvNet(int(config["channels"]), len(self.labels))
        self.net.load_state_dict(load_file(os.path.join(model_dir, "model.safetensors")))
        self.net.to(self.device).eval()

    def prepare(self, request: Request) -> tuple[int, list[float]]:
        body = request.body
        if isinstance(body, (bytes, bytearray, str)):
            try:
                body = json.loads(body)
            except ValueError:
                raise BadInput('send JSON {"values": [numbers]}') from None
        values = body.get("values") if isinstance(body, dict) else None
        if not isinstance(values, list) or not values or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise BadInput('send JSON {"values": [numbers]} with at least one number')
        return len(values), [float(v) for v in values]

    @torch.inference_mode()
    def forward(self, batch: Batch) -> list:
        signal = torch.zeros(batch.size, batch.bucket)
        mask = torch.zeros(batch.size, batch.bucket)
        for row, item in enumerate(batch.items):
            signal[row, : item.length] = torch.tensor(item.input)
            mask[row, : item.length] = 1.0
        scores = torch.softmax(self.net(signal.to(self.device), mask.to(self.device)), dim=-1).cpu().tolist()
        return [{"label": self.labels[max(range(len(s)), key=s.__getitem__)],
                 "scores": dict(zip(self.labels, s)), "length": item.length}
                for s, item in zip(scores, batch.items)]

    def example(self, length: int) -> list[float]:
        return [0.5] * length

    def describe(self) -> dict:
        return {"device": str(self.device), "max_length": self.max_length, "torch_threads": torch.get_num_threads(),
                "model": "ConvNet", "torch": torch.__version__}

    def use_threads(self, count: int, background: bool = False) -> None:
        use_intra_op_threads(count)  # a bare torch.set_num_threads on a lane does not stay set
