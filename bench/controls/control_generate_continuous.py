"""CONTROL (generation), not tsbatch: TorchServe 0.12's documented continuous-batching pattern.

What TorchServe's own examples do (test/pytest/test_data/streaming/stream_handler.py, the
Inferentia2 continuous-batching handler under examples/large_models/), written here from their
description: model-config.yaml sets `continuousBatching: true` and a `batchSize`; while any request
is in flight the frontend calls the handler back to back, each call carrying every live request
again (an in-flight one as an empty row with its request id) plus new arrivals up to batchSize
in all. The handler keeps each request's state in `context.cache` under its request id, prefills
the new ones (their first token), decodes one token for the others, and gives EVERY request one
reply element per call; `context.stopping_criteria[i]` tells the frontend whether that element was
the request's last (ts_stream_next false) or more follow. So every answer goes out as HTTP chunks,
one call at a time.

Here: new requests are prefilled together (left-padded to the longest prompt, masked, positions
from the mask), running ones decode together on their own KV caches left-padded to the longest
(the examples' pad-and-concatenate each step), both in the same call, greedy. A request with
"stream": true gets one NDJSON line {"token": id, "text": piece} per call and the whole answer as
its last line; one without gets an empty element on each call but its last, which carries its whole
JSON answer. Answers as control_generate_fifo.py's (the same as alone). A request the frontend no
longer sends (its client went away) is dropped from the cache. Any exception fails the whole call,
as the pattern does. Admission is only batchSize: the frontend's queue is first come, first served.
"""
import inspect
import json
import os
import types

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

NDJSON = "application/x-ndjson"
JSON = "application/json"


def _live(prompt, max_new_tokens, stream):
    """One request's state between calls (TorchServe imports a handler file with exactly one class):
    its prompt, what it asked for, its tokens so far and its KV cache (keys, values per layer, each
    [1, heads, length, head_dim])."""
    return types.SimpleNamespace(prompt=prompt, max_new_tokens=max_new_tokens, stream=stream, tokens=[], layers=None,
                                 last_was_eos=False, done=False)


def _stop(last):
    """context.stopping_criteria's element for one request: called with its reply, says if it was the last."""
    return lambda _reply: last


class ControlGenerateContinuous:
    def initialize(self, context):
        model_dir = os.path.join(context.system_properties["model_dir"], "model")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.lm = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, use_safetensors=True).eval()
        self.pad_id = self.tokenizer.pad_token_id or 0
        eos = self.lm.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        threads = ((context.model_yaml_config or {}).get("handler") or {}).get("torch_threads")
        if threads:
            torch.set_num_threads(threads)
        # transformers 5 names the KV cache `cache` (argument and output), 4.x `past_key_values`
        self.cache_name = "cache" if "cache" in inspect.signature(self.lm.forward).parameters else "past_key_values"
        context.cache = {}
        self.initialized = True

    def handle(self, data, context):
        rids = [context.request_ids[i] for i in range(len(data))]
        for gone in set(context.cache) - set(rids):  # the frontend dropped it: its client closed the connection
            del context.cache[gone]
        new, running = [], []
        for rid, row in zip(rids, data):
            if rid in context.cache:
                running.append(rid)
                continue
            value = row.get("body") if row.get("body") is not None else row.get("data")
            if isinstance(value, (bytes, bytearray)):
                value = json.loads(value)
            prompt = self.tokenizer(value["text"], add_special_tokens=False)["input_ids"]
            context.cache[rid] = _live(prompt, int(value.get("max_new_tokens", 16)), bool(value.get("stream", False)))
            new.append(rid)
        with torch.inference_mode():
            if running:
                self._decode([context.cache[rid] for rid in running])
            if new:
                self._prefill([context.cache[rid] for rid in new])
        replies, stops = [], []
        for index, rid in enumerate(rids):
            live = context.cache[rid]
            replies.append(self._reply(live))
            stops.append(_stop(live.done))
            context.set_response_content_type(index, NDJSON if live.stream else JSON)
            context.set_response_header(index, "x-tsbatch-batch-size", str(len(rids)))
            if live.done:
                del context.cache[rid]
        context.stopping_criteria = stops
        return replies

    def _reply(self, live):
        answer = {"generated_text": self.tokenizer.decode(live.tokens, skip_special_tokens=True),
                  "new_tokens": len(live.tokens)}
        if not live.stream:
            return json.dumps(answer) if live.done else ""
        out = ""
        if live.tokens and not (live.done and live.last_was_eos):
            token = live.tokens[-1]
            out = json.dumps({"token": token, "text": self.tokenizer.decode([token])}) + "\n"
        return out + (json.dumps(answer) + "\n" if live.done else "")

    def _advance(self, seqs, logits, layers, pads):
        """Each sequence's greedy next token, and its cache cut from the step's batch without padding."""
        tokens = logits[:, -1].float().argmax(dim=-1).tolist()
        for row, (live, token, pad) in enumerate(zip(seqs, tokens, pads)):
            live.layers = tuple((k[row:row + 1, :, pad:], v[row:row + 1, :, pad:]) for k, v in layers)
            live.last_was_eos = token in self.eos_ids
            if not live.last_was_eos:
                live.tokens.append(token)
            live.done = live.last_was_eos or len(live.tokens) >= live.max_new_tokens

    def _prefill(self, seqs):
        longest = max(len(live.prompt) for live in seqs)
        ids = torch.full((len(seqs), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), longest), dtype=torch.long)
        for row, live in enumerate(seqs):
            ids[row, longest - len(live.prompt):] = torch.tensor(live.prompt, dtype=torch.long)
            mask[row, longest - len(live.prompt):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits, layers = self._forward(ids, mask, positions, DynamicCache())
        self._advance(seqs, logits, layers, [longest - len(live.prompt) for live in seqs])

    def _decode(self, seqs):
        lengths = [live.layers[0][0].shape[-2] for live in seqs]
        longest = max(lengths)
        layers = []
        for layer in range(len(seqs[0].layers)):
            keys, values = seqs[0].layers[layer]
            shape = (len(seqs), keys.shape[1], longest, keys.shape[3])
            batch_keys, batch_values = keys.new_zeros(shape), values.new_zeros(shape)
            for row, live in enumerate(seqs):
                k, v = live.layers[layer]
                batch_keys[row, :, longest - lengths[row]:] = k[0]
                batch_values[row, :, longest - lengths[row]:] = v[0]
            layers.append((batch_keys, batch_values))
        mask = torch.zeros((len(seqs), longest + 1), dtype=torch.long)
        for row, length in enumerate(lengths):
            mask[row, longest - length:] = 1
        ids = torch.tensor([[live.tokens[-1]] for live in seqs], dtype=torch.long)
        positions = torch.tensor([[length] for length in lengths], dtype=torch.long)
        logits, grown = self._forward(ids, mask, positions, DynamicCache(ddp_cache_data=layers))
        self._advance(seqs, logits, grown, [longest - length for length in lengths])

    def _forward(self, ids, mask, positions, cache):
        out = self.lm(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                      **{self.cache_name: cache})
        return out.logits, tuple((k, v) for k, v, *_ in out[self.cache_name])
