"""The serving layer: turns many concurrent utterances into batched model calls.

One request per utterance, the scheduler that picks which chunks run together, chunk and
call planning, the runner that owns the caches, the voice-prefix bank and the CUDA graphs,
start-up (graph capture, warm-up), and the LM stages (plain torch, vLLM) behind one
interface. It uses the model layer and the model-directory layer, never the reverse.
"""
