"""The model layer: pure ``nn.Module``s of CosyVoice2-0.5B and the strict loading of a model
directory's weights into them.

Modules here compute; they hold no threads, no cache policy and no CUDA graphs (the
serving layer owns those), as vLLM's model files hold none of its scheduler.
"""
