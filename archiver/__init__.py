"""tsbatch's packaging pipeline: build the .mar and a config.properties for TorchServe."""
