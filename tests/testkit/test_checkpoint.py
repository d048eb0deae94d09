"""The generated CosyVoice2 model directory: layout, yaml, weights, ONNX stand-ins, tokenizer.

The tiny checkpoint is written once per module (~10 s on 2 cores). Its weights are
checked by loading them strictly into the official modules (built from the values of
the written yaml) and into ours; the official flow + HiFT then turn a prompt and some
tokens into finite audio.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from tts_gateway.testkit import checkpoint as ckpt
from tts_gateway.engine.cosyvoice2.frontend import features
from tts_gateway.engine.cosyvoice2.model.flow import Flow
from tts_gateway.engine.cosyvoice2.modeldir.configs import FlowConfig
from tts_gateway.engine.cosyvoice2.frontend.prompt import TOKENIZER_SPECIALS, TextTokenizer
from tts_gateway.engine.cosyvoice2.model.hift import HiFT
from tts_gateway.engine.cosyvoice2.modeldir.configs import HiFTConfig
from tts_gateway.engine.cosyvoice2.model.llm import CosyVoice2LM, qwen2_config
from tts_gateway.engine.cosyvoice2.modeldir.configs import LLMConfig
from tts_gateway.engine.cosyvoice2.modeldir.hyperyaml import ConfigError, YamlObject, load_yaml
from tts_gateway.engine.cosyvoice2.modeldir.mapping import config_from_node
from tts_gateway.engine.cosyvoice2.modeldir.reading import load_model_configs
from tts_gateway.testkit.yaml_writer import write_yaml
from tests.reference import official, official_modules
from tests.paths import DATA

OFFICIAL_YAML = DATA / "cosyvoice2_official.yaml"
FILES = ("cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx",
         "CosyVoice-BlankEN/config.json", "CosyVoice-BlankEN/vocab.json", "CosyVoice-BlankEN/merges.txt",
         "CosyVoice-BlankEN/tokenizer.json", "CosyVoice-BlankEN/tokenizer_config.json")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return ckpt.make_checkpoint(tmp_path_factory.mktemp("cv2") / "tiny", "tiny", seed=0)


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _voiced(seconds: float, rate: int, f0: float = 140.0, seed: int = 0) -> np.ndarray:
    """A vowel-like test signal: harmonics of a gliding f0 with a syllable envelope, plus a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    pitch = f0 * (1 + 0.08 * np.sin(2 * np.pi * 0.7 * t))
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    x = sum((0.6 / k) * np.sin(k * phase) for k in range(1, 12))
    envelope = 0.55 + 0.45 * np.sin(2 * np.pi * 3.0 * t) ** 2
    x = x * envelope + 0.01 * rng.standard_normal(t.size)
    return (0.3 * x / np.abs(x).max()).astype(np.float32)


# ----------------------------------------------------------------------------- layout and yaml


def test_every_file_is_written(tiny_dir: Path):
    for name in FILES:
        assert (tiny_dir / name).is_file(), name
    assert not list(tiny_dir.rglob("*.tmp"))


def test_written_yaml_reads_back_to_the_same_configs(tiny_dir: Path):
    llm, flow, hift = ckpt.checkpoint_configs("tiny")
    configs = load_model_configs(tiny_dir)
    assert configs.llm == llm and configs.flow == flow and configs.hift == hift
    assert configs.frontend.tokenizer_path == str(tiny_dir / "CosyVoice-BlankEN")
    assert (configs.sample_rate, configs.token_frame_rate, configs.token_mel_ratio) == (24000, 25, 2)
    assert configs.ignored == [] and configs.unused == [f"__set_seed{i}" for i in range(1, 5)]


@pytest.mark.parametrize("size", ["full", "tiny"])
def test_yaml_round_trip(tmp_path: Path, size: str):
    llm, flow, hift = ckpt.checkpoint_configs(size)
    path = write_yaml(tmp_path / "cosyvoice2.yaml", llm, flow, hift)
    back = load_model_configs(path, qwen_config=dict(llm.qwen))
    assert (back.llm, back.flow, back.hift) == (llm, flow, hift)
    text = path.read_text()
    # the released file's tags and links
    for line in ("llm: !new:cosyvoice.llm.llm.Qwen2LM", "    llm: !new:cosyvoice.llm.llm.Qwen2Encoder",
                 "        pretrain_path: !ref <qwen_pretrain_path>",
                 "    sampling: !name:cosyvoice.utils.common.ras_sampling",
                 "flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec",
                 "        cfm_params: !new:omegaconf.DictConfig",
                 "            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>",
                 "hift: !new:cosyvoice.hifigan.generator.HiFTGenerator", "    sampling_rate: !ref <sample_rate>",
                 "get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer", "allowed_special: 'all'",
                 "feat_extractor: !name:matcha.utils.audio.mel_spectrogram"):
        assert line in text.splitlines(), line


def test_official_training_yaml_parses_to_the_full_configs():
    configs = load_model_configs(OFFICIAL_YAML)
    assert configs.llm == LLMConfig.full()
    assert configs.flow == FlowConfig.full()
    assert configs.hift == HiFTConfig.full()
    fe = configs.frontend
    assert (fe.n_fft, fe.num_mels, fe.sampling_rate, fe.hop_size, fe.win_size, fe.fmin, fe.fmax, fe.center) == (
        1920, 80, 24000, 480, 1920, 0, 8000, False)
    assert fe.allowed_special == "all" and fe.skip_special_tokens is True
    assert (configs.chunk_size, configs.num_decoding_left_chunks) == (25, -1)
    # GAN, dataset and training entries are parsed (inertly) and reported unused
    assert {"hifigan", "data_pipeline", "train_conf", "compute_fbank"} <= set(configs.unused)


def test_hyperpyyaml_tags_are_inert_and_refs_resolve():
    doc = load_yaml(OFFICIAL_YAML)
    seed = doc["__set_seed3"]
    assert seed == YamlObject("apply", "torch.manual_seed", {}, [1986])
    estimator = doc["flow"].kwargs["decoder"].kwargs["estimator"]
    assert estimator.kwargs["static_chunk_size"] == 50
    cfm = doc["flow"].kwargs["decoder"].kwargs["cfm_params"]
    assert cfm["sigma_min"] == 1e-06 and isinstance(cfm["sigma_min"], float)
    assert doc["hifigan"].kwargs["generator"] is doc["hift"]  # a !ref to a node is the node
    assert doc["data_pipeline"][0].target == "cosyvoice.dataset.processor.parquet_opener"
    text = "a: 3\nb: !ref <a> * 2 + 1\nc: !ref <a>/save\nd: !ref <e[x]>\ne: {x: 7}\n"
    resolved = load_yaml(text)
    assert (resolved["b"], resolved["c"], resolved["d"]) == (7, "3/save", 7)
    assert load_yaml(text, overrides={"a": 5})["b"] == 11
    with pytest.raises(ConfigError, match="circular"):
        load_yaml("a: !ref <b>\nb: !ref <a>\n")


def _official_text() -> str:
    return OFFICIAL_YAML.read_text()


@pytest.mark.parametrize(
    "old,new,message",
    [
        ("    pre_lookahead_len: 3\n", "    pre_lookahead_len: 3\n    sparse_attention: True\n", "sparse_attention"),
        ("hift: !new:cosyvoice.hifigan.generator.HiFTGenerator",
         "hift: !new:cosyvoice.hifigan.generator.HiFTGenerator2", "HiFTGenerator2"),
        ("        use_cnn_module: False", "        use_cnn_module: True", "use_cnn_module"),
        ("    llm: !new:cosyvoice.llm.llm.Qwen2Encoder", "    llm: !new:cosyvoice.llm.llm.TransformerEncoder",
         "Qwen2Encoder"),
        ("    sampling_rate: !ref <sample_rate>\n    nsf_alpha", "    sampling_rate: 22050\n    nsf_alpha",
         "sampling_rate"),
    ],
)
def test_unsupported_configs_fail_loudly(old: str, new: str, message: str):
    text = _official_text()
    assert old in text
    with pytest.raises(ConfigError, match=message):
        load_model_configs_text(text.replace(old, new, 1))


def load_model_configs_text(text: str):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cosyvoice2.yaml"
        path.write_text(text)
        return load_model_configs(path)


def test_training_only_arguments_are_skipped_and_listed():
    @dataclasses.dataclass
    class LeanFlow:
        OFFICIAL_TARGET = "cosyvoice.flow.flow.CausalMaskedDiffWithXvec"
        input_size: int = 512

    ignored: list[str] = []
    node = YamlObject("new", LeanFlow.OFFICIAL_TARGET, {"input_size": 256, "only_mask_loss": True})
    assert config_from_node(LeanFlow, node, "flow", ignored) == LeanFlow(256)
    assert ignored == ["flow.only_mask_loss"]
    with pytest.raises(ConfigError, match="unsupported argument"):
        config_from_node(LeanFlow, YamlObject("new", LeanFlow.OFFICIAL_TARGET, {"output_type": "linear"}), "flow")


def test_unused_official_arguments_are_ignored_and_reported():
    anchor = "        static_chunk_size: !ref <chunk_size>\n"
    text = _official_text().replace(anchor, anchor + "        use_dynamic_chunk: False\n", 1)
    configs = load_model_configs_text(text)
    assert configs.flow == FlowConfig.full()
    assert configs.ignored == ["flow.encoder.use_dynamic_chunk"]


def test_official_hyperpyyaml_loads_what_we_write(tiny_dir: Path, tmp_path: Path, official_tokenizer_module):
    """The official loader builds the official modules from our yaml, and they take our weights strictly."""
    import hyperpyyaml
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_dir, model_dir)
    # Qwen2Encoder calls from_pretrained on CosyVoice-BlankEN: give it (random) blank weights
    from transformers import Qwen2ForCausalLM

    Qwen2ForCausalLM(qwen2_config(LLMConfig.tiny())).save_pretrained(model_dir / "CosyVoice-BlankEN")
    official("cosyvoice.llm.llm")
    with open(model_dir / "cosyvoice2.yaml") as f:
        overrides = {"qwen_pretrain_path": str(model_dir / "CosyVoice-BlankEN")}
        configs = hyperpyyaml.load_hyperpyyaml(f, overrides=overrides)
    configs["llm"].load_state_dict(_load(model_dir / "llm.pt"), strict=True)
    configs["flow"].load_state_dict(_load(model_dir / "flow.pt"), strict=True)
    hift_state = {k.replace("generator.", ""): v for k, v in _load(model_dir / "hift.pt").items()}
    configs["hift"].load_state_dict(hift_state, strict=True)
    assert configs["sample_rate"] == 24000
    tok = configs["get_tokenizer"]()
    ours = TextTokenizer(model_dir / "CosyVoice-BlankEN")
    assert tok.encode("Hello there, how are you?") == ours.encode("Hello there, how are you?")


# ----------------------------------------------------------------------------- weights


def test_weights_load_strictly_into_official_modules_and_make_finite_audio(tiny_dir: Path):
    configs = load_model_configs(tiny_dir)
    llm, flow, hift = official_modules(configs.llm, configs.flow, configs.hift)
    llm.load_state_dict(_load(tiny_dir / "llm.pt"), strict=True)
    flow.load_state_dict(_load(tiny_dir / "flow.pt"), strict=True)
    hift_state = _load(tiny_dir / "hift.pt")
    assert not any(k.startswith("generator.") for k in hift_state)  # as released: bare generator keys
    assert "conv_pre.parametrizations.weight.original0" in hift_state
    hift.load_state_dict({k.replace("generator.", ""): v for k, v in hift_state.items()}, strict=True)
    assert all(v.dtype == torch.float32 for v in _load(tiny_dir / "llm.pt").values())

    # prompt: conditioning from our frontend; tokens: a random draw
    from tts_gateway.engine.cosyvoice2.frontend.prompt import CosyVoice2Frontend

    voice = CosyVoice2Frontend(tiny_dir, configs).prepare(_voiced(1.2, 24000), 24000, "A short prompt.")
    torch.manual_seed(0)
    tokens = torch.randint(0, 6561, (1, 20), dtype=torch.int32)
    flow.eval(), hift.eval()
    with torch.inference_mode():
        mel, _ = flow.inference(tokens, torch.tensor([20], dtype=torch.int32), voice.speech_tokens,
                                torch.tensor([voice.speech_tokens.shape[1]], dtype=torch.int32), voice.speech_feat,
                                torch.tensor([voice.speech_feat.shape[1]], dtype=torch.int32), voice.embedding,
                                streaming=False, finalize=True)
        audio, _ = hift.inference(speech_feat=mel)
    assert mel.shape == (1, 80, 40) and torch.isfinite(mel).all() and mel.abs().max() < 1e3
    assert audio.shape == (1, 40 * 480) and torch.isfinite(audio).all()
    assert 1e-4 < audio.abs().max() <= 0.99 + 1e-6


def test_weights_load_strictly_into_our_modules(tiny_dir: Path):
    configs = load_model_configs(tiny_dir)
    CosyVoice2LM(configs.llm).load_state_dict(_load(tiny_dir / "llm.pt"), strict=True)
    Flow(configs.flow).load_state_dict(_load(tiny_dir / "flow.pt"), strict=True)
    HiFT(configs.hift).load_state_dict(_load(tiny_dir / "hift.pt"), strict=True)


def test_weights_are_deterministic_and_sane(tiny_dir: Path):
    state = _load(tiny_dir / "hift.pt")
    again = ckpt._build_module("hift", ckpt.checkpoint_configs("tiny")[2], seed=0).state_dict()
    assert all(torch.equal(state[k], again[k]) for k in state)
    for name in ("llm.pt", "flow.pt", "hift.pt"):
        for key, value in _load(tiny_dir / name).items():
            if value.is_floating_point() and value.numel() > 1:
                assert torch.isfinite(value).all(), key
                assert value.abs().max() < 100, key


# ----------------------------------------------------------------------------- ONNX stand-ins


def _ort(path: Path):
    import onnxruntime

    option = onnxruntime.SessionOptions()
    option.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    option.intra_op_num_threads = 1
    return onnxruntime.InferenceSession(str(path), sess_options=option, providers=["CPUExecutionProvider"])


def _speech_tokens(session, audio_16k: np.ndarray) -> list[int]:
    # the official _extract_speech_token feeding code path: positional input names, [1, 128, T] + [T] int32
    speech = torch.from_numpy(audio_16k)[None]
    feat = features.log_mel_spectrogram(speech, n_mels=128)
    out = session.run(None, {session.get_inputs()[0].name: feat.detach().cpu().numpy(),
                             session.get_inputs()[1].name: np.array([feat.shape[2]], dtype=np.int32)})
    return out[0].flatten().tolist()


def _embedding(session, audio_16k: np.ndarray) -> list[float]:
    # the official _extract_spk_embedding feeding code path
    feat = features.fbank(torch.from_numpy(audio_16k)[None], num_mel_bins=80, dither=0, sample_frequency=16000)
    feat = feat - feat.mean(dim=0, keepdim=True)
    return session.run(None, {session.get_inputs()[0].name: feat.unsqueeze(dim=0).cpu().numpy()})[0].flatten().tolist()


def test_speech_tokenizer_onnx_interface_and_behaviour(tiny_dir: Path):
    session = _ort(tiny_dir / "speech_tokenizer_v2.onnx")
    ins, outs = session.get_inputs(), session.get_outputs()
    assert [(i.name, i.type) for i in ins] == [("feats", "tensor(float)"), ("feats_length", "tensor(int32)")]
    assert ins[0].shape[1] == 128 and outs[0].type == "tensor(int64)"
    a = _speech_tokens(session, _voiced(3.0, 16000, 120.0))
    b = _speech_tokens(session, _voiced(3.0, 16000, 210.0, seed=1))
    assert len(a) == len(b) == 75  # 300 mel frames -> 25 Hz
    assert all(0 <= t < 6561 for t in a + b)
    assert a != b and len(set(a)) >= 3
    odd = _speech_tokens(session, _voiced(1.01, 16000))  # 101 frames -> ceil(101 / 4)
    assert len(odd) == 26
    # the length input is honoured: frames past it do not count
    feat = features.log_mel_spectrogram(torch.from_numpy(_voiced(2.0, 16000))[None]).numpy()
    full = session.run(None, {"feats": feat, "feats_length": np.array([200], dtype=np.int32)})[0]
    cut = session.run(None, {"feats": feat, "feats_length": np.array([120], dtype=np.int32)})[0]
    assert cut.shape == (1, 30) and np.array_equal(cut[0, :30], full[0, :30])


def test_campplus_onnx_interface_and_behaviour(tiny_dir: Path):
    session = _ort(tiny_dir / "campplus.onnx")
    ins, outs = session.get_inputs(), session.get_outputs()
    assert len(ins) == 1 and ins[0].type == "tensor(float)" and ins[0].shape[2] == 80
    assert len(outs) == 1 and outs[0].shape[1] == 192
    a = np.array(_embedding(session, _voiced(3.0, 16000, 110.0)))
    b = np.array(_embedding(session, _voiced(3.0, 16000, 230.0, seed=2)))
    assert a.shape == b.shape == (192,) and np.isfinite(a).all()
    cosine = a @ b / np.linalg.norm(a) / np.linalg.norm(b)
    assert cosine < 0.9999 and 0.1 < np.linalg.norm(a) < 1e3


def test_onnx_models_are_deterministic(tmp_path: Path, tiny_dir: Path):
    ckpt.build_speech_tokenizer_onnx(tmp_path / "s.onnx", seed=0)
    ckpt.build_campplus_onnx(tmp_path / "c.onnx", seed=0)
    assert (tmp_path / "s.onnx").read_bytes() == (tiny_dir / "speech_tokenizer_v2.onnx").read_bytes()
    assert (tmp_path / "c.onnx").read_bytes() == (tiny_dir / "campplus.onnx").read_bytes()
    ckpt.build_campplus_onnx(tmp_path / "c1.onnx", seed=1)
    assert (tmp_path / "c1.onnx").read_bytes() != (tmp_path / "c.onnx").read_bytes()


# ----------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def official_tokenizer_module():
    """cosyvoice.tokenizer.tokenizer, importable without whisper/tiktoken (its QwenTokenizer uses neither)."""
    added = []
    for name in ("tiktoken", "whisper", "whisper.tokenizer"):
        try:
            importlib.import_module(name)
        except ImportError:
            stub = types.ModuleType(name)
            if name == "whisper.tokenizer":
                stub.Tokenizer = type("Tokenizer", (), {})
            if name == "whisper":
                stub.__path__ = []
            sys.modules[name] = stub
            added.append(name)
    try:
        yield official("cosyvoice.tokenizer.tokenizer")
    finally:
        for name in added:
            sys.modules.pop(name, None)


TEXTS = [
    "Hello there, how are you today?",
    "I'm fine; it's 12:45 and we'll leave at 3.",
    "你好，欢迎致电客服中心！",
    "Mixed 中文 and English, with [breath] a breath<|endofprompt|>and <strong>emphasis</strong>.",
    "  spaces   and\nnew lines\t",
    "",
]


def test_tokenizer_matches_the_official_class_offline(tiny_dir: Path, official_tokenizer_module, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = str(tiny_dir / "CosyVoice-BlankEN")
    reference = official_tokenizer_module.QwenTokenizer(path, skip_special_tokens=True)
    ours = TextTokenizer(path)
    assert reference.special_tokens == TOKENIZER_SPECIALS
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text, allowed_special="all"), text
        assert all(0 <= i < 1024 for i in ids)
    specials = ["<|endoftext|>"] + TOKENIZER_SPECIALS["additional_special_tokens"]
    special_ids = [ours.token_id(t) for t in specials]
    assert len(set(special_ids)) == len(specials) and max(special_ids) < 1024
    assert len(ours) <= 1024
    marked = ours.encode("a<|endofprompt|>b")
    assert ours.token_id("<|endofprompt|>") in marked
    assert ours.decode(ours.encode("Hello there, 你好")) == "Hello there, 你好"


def test_tokenizer_config_json_is_the_backbone(tiny_dir: Path):
    config = json.loads((tiny_dir / "CosyVoice-BlankEN" / "config.json").read_text())
    assert config == dict(LLMConfig.tiny().qwen)
    assert config["model_type"] == "qwen2" and config["vocab_size"] == 1024


# ----------------------------------------------------------------------------- CLI


def test_cli_refuses_a_non_empty_directory(tmp_path: Path, capsys):
    (tmp_path / "x").write_text("keep me")
    assert ckpt.main_make_checkpoint([str(tmp_path), "--size", "tiny"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "x").read_text() == "keep me"
    with pytest.raises(SystemExit):
        ckpt.main_make_checkpoint([str(tmp_path), "--size", "huge"])
