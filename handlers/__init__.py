"""tsbatch handlers: what runs inside a TorchServe worker.

Pure modules (no torch, no TorchServe): errors, config, parse, buckets, isolate.
Edges: runner (torch + transformers) and encoder_handler (the TorchServe handler class).
"""
