"""Stand-in for ModelScope, which upstream CosyVoice imports only to download a model whose
directory does not exist. bench/official_baseline.py always passes a local model directory."""


def snapshot_download(model_id, *args, **kwargs):
    raise RuntimeError(f"modelscope is a stub here: {model_id!r} must be a local model directory")
