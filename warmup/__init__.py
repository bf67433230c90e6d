"""tsbatch warmup: plan every shape the handler can form, run it before READY, keep the profile."""
