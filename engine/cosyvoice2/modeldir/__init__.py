"""The model-directory layer: what an official CosyVoice2-0.5B directory holds (its layout)
and what its ``cosyvoice2.yaml`` says (typed configs). Torch-free, so that ``tts-gateway
doctor`` and the voice commands can read a directory where torch is not installed.
"""
