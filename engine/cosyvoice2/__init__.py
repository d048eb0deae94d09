"""CosyVoice2-0.5B: LLM (speech tokens) -> flow matching (mel) -> HiFT (24 kHz audio).

Lean plain-torch modules that load the official model directory's state dicts as they
are, a frontend for zero-shot voices, and a streaming, batched token2wav.
"""
