"""A simulated SGLang server speaking the native ``/generate`` protocol, for tests, demos and benchmarks."""

from tokenfleet.sim.engine import SimConfig
from tokenfleet.sim.server import SimServerThread, build_app, main

__all__ = ["SimConfig", "SimServerThread", "build_app", "main"]
