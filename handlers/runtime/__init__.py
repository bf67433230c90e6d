"""What executes inside a worker around the model: lanes, the Worker, warmup, memory, graphs, the generation engine."""
