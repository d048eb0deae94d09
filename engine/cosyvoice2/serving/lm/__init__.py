"""The LM stage: text token ids in, speech tokens out, per utterance, on plain torch or vLLM."""
