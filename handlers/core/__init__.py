"""The pure core: every decision, with no torch, no TorchServe and no clock of its own."""
