"""BEFORE: the conv net served the way a team writes it for TorchServe alone (a BaseHandler).

preprocess / inference / postprocess over the frontend's whole batch: every signal padded to the
longest in the batch, one pass, and one exception (a bad body, a failing input) fails every
request of the batch. examples/conv1d is the same model ported to tsbatch; README, "Migrating a
BaseHandler", walks through the changes. Kept runnable: tests/integration/test_migration.py checks
that the port answers what this handler answers.
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file
from ts.torch_handler.base_handler import BaseHandler


class ConvBaseHandler(BaseHandler):
    def initialize(self, context):
        model_dir = context.system_properties["model_dir"]
        sys.path.insert(0, model_dir)
        from conv_model import ConvNet  # the same torch.nn.Module the tsbatch port serves

        with open(os.path.join(model_dir, "model", "config.json")) as f:
            config = json.load(f)
        self.labels = list(config["labels"])
        self.net = ConvNet(int(config["channels"]), len(self.labels))
        self.net.load_state_dict(load_file(os.path.join(model_dir, "model", "model.safetensors")))
        self.net.eval()
        self.initialized = True

    def preprocess(self, data):
        signals = []
        for row in data:
            body = row.get("body") or row.get("data")
            if isinstance(body, (bytes, bytearray)):
                body = json.loads(body)
            signals.append([float(v) for v in body["values"]])
        longest = max(len(s) for s in signals)
        signal = torch.zeros(len(signals), longest)
        mask = torch.zeros(len(signals), longest)
        for row, values in enumerate(signals):
            signal[row, : len(values)] = torch.tensor(values)
            mask[row, : len(values)] = 1.0
        return signal, mask, [len(s) for s in signals]

    def inference(self, data, *args, **kwargs):
        signal, mask, lengths = data
        with torch.inference_mode():
            return torch.softmax(self.net(signal, mask), dim=-1).tolist(), lengths

    def postprocess(self, data):
        scores, lengths = data
        return [json.dumps({"label": self.labels[max(range(len(s)), key=s.__getitem__)],
                            "scores": dict(zip(self.labels, s)), "length": n})
                for s, n in zip(scores, lengths)]
