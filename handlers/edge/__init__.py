"""The TorchServe edge: the handler class, parsing and answers, configuration, metrics, the serving modes."""
