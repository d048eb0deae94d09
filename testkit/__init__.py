"""Tooling beside the tests: a random-weight CosyVoice2 model directory in the official
layout (``tts-gateway make-checkpoint``), for the tests and the GPU benchmarks."""
