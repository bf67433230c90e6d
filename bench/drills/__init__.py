"""Chaos drills (`make chaos`, bench/chaos.py): overload at a multiple of capacity, and a worker
killed mid-batch. Each drill is bounded in requests and seconds; tests/e2e runs short versions."""
