"""Generate a random-weight CosyVoice2 model directory in the official layout.

Real weights cannot be downloaded in the development environment, so tests (``tiny``)
and GPU benchmarks (``full``, the released CosyVoice2-0.5B sizes) run on a directory
that looks exactly like the released one::

    cosyvoice2.yaml            hyperpyyaml config (official keys, tags and references)
    llm.pt flow.pt hift.pt     torch.save(state_dict), official key names and shapes, fp32
    campplus.onnx              speaker encoder: [1, T, 80] fbank -> [1, 192]
    speech_tokenizer_v2.onnx   [1, 128, T] log-mel + [1] length -> [1, ceil(T/4)] ids < 6561
    CosyVoice-BlankEN/         Qwen2 config.json + a stand-in byte-level BPE tokenizer

The weights are random but initialised so that activations stay bounded, and the two
ONNX models are small deterministic graphs that depend on their input (different
audio gives different tokens and embeddings) without modelling anything.

Differences from a released directory, by design: ``CosyVoice-BlankEN`` has no
``model.safetensors`` (the blank Qwen weights are overwritten by ``llm.pt`` anyway; the
official loader would need them, this engine does not) and its tokenizer is a small BPE
learned on a built-in text, not Qwen's 151k vocabulary. Real users bring the real
directory, tokenizer included.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "SPEECH_TOKENIZER_INPUTS",
    "CAMPPLUS_INPUT",
    "QWEN_SPECIAL_TOKENS",
    "COSYVOICE_SPECIAL_TOKENS",
    "build_speech_tokenizer_onnx",
    "build_campplus_onnx",
    "build_tokenizer",
    "make_checkpoint",
    "main_make_checkpoint",
]

SPEECH_TOKEN_VOCAB = 6561  # 3 ** 8: finite scalar quantisation, 8 dims x 3 levels
SPEAKER_DIM = 192
SPEECH_TOKENIZER_INPUTS = ("feats", "feats_length")
SPEECH_TOKENIZER_OUTPUT = "indices"
CAMPPLUS_INPUT = "input"
CAMPPLUS_OUTPUT = "output"
ONNX_OPSET = 17
ONNX_IR_VERSION = 8

# The special tokens the Qwen2 tokenizer itself defines (ids after the BPE vocabulary).
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# The extra tokens the CosyVoice2 frontend registers on top (see frontend.TOKENIZER_SPECIALS).
COSYVOICE_SPECIAL_TOKENS = (
    "<|endofprompt|>", "[breath]", "<strong>", "</strong>", "[noise]", "[laughter]", "[cough]", "[clucking]",
    "[accent]", "[quick_breath]", "<laughter>", "</laughter>", "[hissing]", "[sigh]", "[vocalized-noise]",
    "[lipsmack]", "[mn]",
)


# ---------------------------------------------------------------------------
# ONNX stand-ins


def _rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def _save_onnx(graph, doc: str, path: str | os.PathLike) -> Path:
    """Wrap a stand-in graph in a checked model and write it atomically."""
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)],
                              producer_name="tts-gateway make-checkpoint")
    model.ir_version = ONNX_IR_VERSION
    model.doc_string = doc
    onnx.checker.check_model(model, full_check=True)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(model.SerializeToString())
    os.replace(tmp, out)
    return out


def build_speech_tokenizer_onnx(path: str | os.PathLike, seed: int = 0) -> Path:
    """A stand-in ``speech_tokenizer_v2.onnx`` with the official interface.

    Inputs ``feats`` ``[B, 128, T]`` float32 (Whisper log-mel, 100 frames/s) and
    ``feats_length`` ``[B]`` int32; output ``indices`` ``[B, ceil(T / 4)]`` int64 in
    ``[0, 6561)`` at 25 Hz. The graph keeps the first ``feats_length`` frames, averages
    every 4 frames, standardises each pooled frame over its 128 bins, projects it to 8
    dimensions with a fixed random matrix and quantises each to {-1, 0, 1}; the token
    is the base-3 number those 8 digits spell (the real tokenizer's FSQ layout).
    """
    from onnx import TensorProto, helper, numpy_helper

    rng = _rng(seed, "speech_tokenizer_v2")
    projection = (rng.standard_normal((128, 8)) / math.sqrt(128.0)).astype(np.float32)
    powers = (3.0 ** np.arange(8, dtype=np.float64)).astype(np.float32).reshape(8, 1)
    inits = [
        numpy_helper.from_array(projection, "projection"),
        numpy_helper.from_array(powers, "base3"),
        numpy_helper.from_array(np.array([0], dtype=np.int64), "zero"),
        numpy_helper.from_array(np.array([2], dtype=np.int64), "time_axis"),
        numpy_helper.from_array(np.array(1e-5, dtype=np.float32), "eps"),
        numpy_helper.from_array(np.array(-1.0, dtype=np.float32), "lo"),
        numpy_helper.from_array(np.array(1.0, dtype=np.float32), "hi"),
        numpy_helper.from_array(np.array([2], dtype=np.int64), "last_axis"),
    ]
    nodes = [
        helper.make_node("Cast", ["feats_length"], ["length64"], to=TensorProto.INT64),
        helper.make_node("ReduceMax", ["length64"], ["end"], axes=[0], keepdims=1),
        helper.make_node("Slice", ["feats", "zero", "end", "time_axis"], ["valid"]),
        helper.make_node("AveragePool", ["valid"], ["pooled"], kernel_shape=[4], strides=[4], ceil_mode=1),
        helper.make_node("ReduceMean", ["pooled"], ["mean"], axes=[1], keepdims=1),
        helper.make_node("Sub", ["pooled", "mean"], ["centred"]),
        helper.make_node("Mul", ["centred", "centred"], ["square"]),
        helper.make_node("ReduceMean", ["square"], ["var"], axes=[1], keepdims=1),
        helper.make_node("Add", ["var", "eps"], ["var_eps"]),
        helper.make_node("Sqrt", ["var_eps"], ["std"]),
        helper.make_node("Div", ["centred", "std"], ["normed"]),
        helper.make_node("Transpose", ["normed"], ["frames"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["frames", "projection"], ["latent"]),
        helper.make_node("Clip", ["latent", "lo", "hi"], ["clipped"]),
        helper.make_node("Round", ["clipped"], ["levels"]),
        helper.make_node("Add", ["levels", "hi"], ["digits"]),
        helper.make_node("MatMul", ["digits", "base3"], ["code"]),
        helper.make_node("Squeeze", ["code", "last_axis"], ["code_2d"]),
        helper.make_node("Cast", ["code_2d"], [SPEECH_TOKENIZER_OUTPUT], to=TensorProto.INT64),
    ]
    graph = helper.make_graph(
        nodes,
        "speech_tokenizer_v2_standin",
        [
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, ["batch", 128, "frames"]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, ["batch"]),
        ],
        [helper.make_tensor_value_info(SPEECH_TOKENIZER_OUTPUT, TensorProto.INT64, ["batch", "tokens"])],
        inits,
    )
    return _save_onnx(graph, "Random stand-in for the CosyVoice2 speech tokenizer (not a trained model).", path)


def build_campplus_onnx(path: str | os.PathLike, seed: int = 0, hidden: int = 256) -> Path:
    """A stand-in ``campplus.onnx``: ``input`` ``[B, T, 80]`` fbank -> ``output`` ``[B, 192]``.

    Frame-wise ReLU layer, then mean and standard deviation over time (statistics
    pooling, as in x-vector style speaker encoders), then a linear map to 192 dims.
    """
    from onnx import TensorProto, helper, numpy_helper

    rng = _rng(seed, "campplus")
    w1 = (rng.standard_normal((80, hidden)) / math.sqrt(80.0)).astype(np.float32)
    b1 = (0.5 * rng.standard_normal(hidden)).astype(np.float32)
    w2 = (rng.standard_normal((2 * hidden, SPEAKER_DIM)) / math.sqrt(2.0 * hidden)).astype(np.float32)
    b2 = (0.1 * rng.standard_normal(SPEAKER_DIM)).astype(np.float32)
    inits = [
        numpy_helper.from_array(w1, "w1"),
        numpy_helper.from_array(b1, "b1"),
        numpy_helper.from_array(w2, "w2"),
        numpy_helper.from_array(b2, "b2"),
        numpy_helper.from_array(np.array(1e-5, dtype=np.float32), "eps"),
    ]
    nodes = [
        helper.make_node("MatMul", [CAMPPLUS_INPUT, "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h"]),
        helper.make_node("ReduceMean", ["h"], ["mean"], axes=[1], keepdims=1),
        helper.make_node("Sub", ["h", "mean"], ["dev"]),
        helper.make_node("Mul", ["dev", "dev"], ["dev2"]),
        helper.make_node("ReduceMean", ["dev2"], ["var"], axes=[1], keepdims=0),
        helper.make_node("Add", ["var", "eps"], ["var_eps"]),
        helper.make_node("Sqrt", ["var_eps"], ["std"]),
        helper.make_node("ReduceMean", ["h"], ["mean2d"], axes=[1], keepdims=0),
        helper.make_node("Concat", ["mean2d", "std"], ["stats"], axis=1),
        helper.make_node("MatMul", ["stats", "w2"], ["e0"]),
        helper.make_node("Add", ["e0", "b2"], [CAMPPLUS_OUTPUT]),
    ]
    graph = helper.make_graph(
        nodes,
        "campplus_standin",
        [helper.make_tensor_value_info(CAMPPLUS_INPUT, TensorProto.FLOAT, ["batch", "frames", 80])],
        [helper.make_tensor_value_info(CAMPPLUS_OUTPUT, TensorProto.FLOAT, ["batch", SPEAKER_DIM])],
        inits,
    )
    return _save_onnx(graph, "Random stand-in for the CAM++ speaker encoder (not a trained model).", path)


# ---------------------------------------------------------------------------
# Tokenizer stand-in

# A short English + Chinese text (written for this project) the stand-in BPE is learned on:
# everyday words, digits and punctuation, so the merges look like a real tokenizer's.
_CORPUS_ENGLISH = """\
Hello there! Thanks for calling. How can I help you today?
I'm looking at your order right now, and it should arrive on Tuesday, the 14th of March.
The weather is lovely this morning: sunny, with a light breeze from the west.
Could you please repeat the last part? I didn't quite catch what you said.
Sure, no problem. Your reference number is 4 8 1 5 1 6 2 3 4 2.
We're open from 9 a.m. to 5 p.m., Monday through Friday, and until noon on Saturday.
Let me check that for you. It'll only take a moment, so please stay on the line.
The meeting has been moved to Thursday afternoon at half past three.
She said the train was late again, so they took a taxi into the city instead.
What would you like to drink? We have coffee, tea, orange juice and sparkling water.
If you have any other questions, don't hesitate to ask. I'm always happy to help.
The quick brown fox jumps over the lazy dog while the cat watches from the window.
Our new phone plan costs $29.99 per month and includes unlimited calls and texts.
I think that's a great idea; let's try it out and see how it goes next week.
Good evening, everyone, and welcome to the show. Tonight we have a very special guest.
He opened the door, looked around the empty room, and slowly walked to the desk.
Please remember to bring your passport, your ticket and a copy of your booking.
Is there anything else I can do for you? Have a wonderful day, and take care!
Actually, I was wondering whether you could recommend a good restaurant nearby.
They were talking about music, movies, books, travel, and the places they'd visited.
One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve.
First of all, let me say how pleased we are that you could join us today.
Well, that depends on what you mean by "fast". Some people would say it's quite slow.
The results were better than expected: sales grew by 12% in the second quarter.
Why don't we meet at the station at seven o'clock and walk to the concert hall together?
"""

_CORPUS_CHINESE = """\
你好，欢迎致电客服中心，请问有什么可以帮您？
今天天气很好，阳光明媚，我们一起去公园散步吧。
您的订单已经发货了，预计明天下午送到。
请稍等，我帮您查询一下相关的信息。
谢谢您的耐心等待，祝您生活愉快！
我们公司成立于二零一五年，现在有三百多名员工。
这个问题我不太清楚，我需要问一下我的同事。
春天来了，花开了，小鸟在树上唱歌。
他每天早上六点起床，然后去跑步，再吃早饭。
如果您还有其他问题，请随时联系我们。
"""



# Qwen2's pre-tokenizer split (single digits, contractions, letters, punctuation runs).
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def build_tokenizer(directory: str | os.PathLike, max_vocab: int = 1024) -> dict[str, int]:
    """Write a byte-level BPE tokenizer in Qwen2's file layout; returns {token: id} of the specials.

    The BPE is learned on a short built-in English + Chinese text with Qwen2's
    normaliser (NFC), pre-tokenizer split and byte-level alphabet, so any text
    round-trips. Qwen2's own special tokens follow the learned vocabulary, and the
    frontend's added tokens (:data:`COSYVOICE_SPECIAL_TOKENS`) come right after them, so
    every id stays below ``max_vocab``. Files: ``vocab.json``, ``merges.txt``,
    ``tokenizer.json``, ``tokenizer_config.json``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    n_special = len(QWEN_SPECIAL_TOKENS) + len(COSYVOICE_SPECIAL_TOKENS)
    budget = max_vocab - n_special
    if budget < 300:
        raise ValueError(f"max_vocab {max_vocab} leaves no room for a byte-level vocabulary")
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=budget, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((_CORPUS_ENGLISH + _CORPUS_CHINESE).splitlines(), trainer)
    tok.add_special_tokens(list(QWEN_SPECIAL_TOKENS))
    specials = {t: tok.token_to_id(t) for t in QWEN_SPECIAL_TOKENS}
    if max(specials.values()) + len(COSYVOICE_SPECIAL_TOKENS) >= max_vocab:
        raise AssertionError("tokenizer ids exceed the text vocabulary")
    tok.save(str(out / "tokenizer.json"))
    tok.model.save(str(out))  # vocab.json + merges.txt
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True}
        for t, i in specials.items()
    }
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "GENERATED.txt").write_text(
        "Stand-in tokenizer written by `tts-gateway make-checkpoint`: a small byte-level BPE in\n"
        "Qwen2's file layout, not the real Qwen vocabulary. Use the released CosyVoice-BlankEN\n"
        "directory for real speech.\n"
    )
    return specials


# ---------------------------------------------------------------------------
# Model weights


SIZES = ("full", "tiny")


def checkpoint_configs(size: str):
    """``(LLMConfig, FlowConfig, HiFTConfig)`` of a generated checkpoint.

    ``tiny`` uses each module's ``tiny()`` config, except that the flow keeps the real
    6561-token vocabulary so that every speech token the LLM (or the speech tokenizer)
    emits can be fed to it.
    """
    import dataclasses

    from tts_gateway.engine.cosyvoice2.modeldir.configs import FlowConfig
    from tts_gateway.engine.cosyvoice2.modeldir.configs import HiFTConfig
    from tts_gateway.engine.cosyvoice2.modeldir.configs import LLMConfig

    if size == "full":
        return LLMConfig.full(), FlowConfig.full(), HiFTConfig.full()
    if size == "tiny":
        llm = LLMConfig.tiny()
        flow = dataclasses.replace(FlowConfig.tiny(), vocab_size=llm.speech_token_size)
        return llm, flow, HiFTConfig.tiny()
    raise ValueError(f"size must be one of {SIZES}, got {size!r}")


def _seed_for(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:4], "little")


def _save_state_dict(module, path: Path) -> int:
    import torch

    state = module.state_dict()
    for key, value in state.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise AssertionError(f"{path.name}: {key} is not finite after initialisation")
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    unique = {v.untyped_storage().data_ptr(): v.numel() for v in state.values()}  # tied weights once
    return sum(unique.values())


def _build_module(kind: str, cfg, seed: int):
    """One of our modules with deterministic random weights (default initialisers, fp32)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seed_for(seed, kind))
        if kind == "llm":
            from tts_gateway.engine.cosyvoice2.model.llm import CosyVoice2LM

            module = CosyVoice2LM(cfg)
        elif kind == "flow":
            from tts_gateway.engine.cosyvoice2.model.flow import Flow

            module = Flow(cfg)
        elif kind == "hift":
            from tts_gateway.engine.cosyvoice2.model.hift import HiFT

            module = HiFT(cfg)
        else:  # pragma: no cover
            raise ValueError(kind)
    return module.float().eval()


def make_checkpoint(out_dir: str | os.PathLike, size: str = "tiny", seed: int = 0, *,
                    weights: bool = True, log=None) -> Path:
    """Write a complete random-weight model directory; returns its path.

    Modules are built, saved and freed one at a time, so ``full`` (about 0.6 B fp32
    parameters, ~2.4 GB on disk) needs a few GB of memory at most. ``weights=False``
    skips the three ``.pt`` files (a frontend-only directory, for tests).
    """
    from tts_gateway.engine.cosyvoice2.modeldir.layout import TOKENIZER_DIR
    from tts_gateway.testkit.yaml_writer import write_yaml

    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    say = log or (lambda message: None)
    llm_cfg, flow_cfg, hift_cfg = checkpoint_configs(size)

    tok_dir = out / TOKENIZER_DIR
    tok_dir.mkdir(exist_ok=True)
    text_vocab = int(llm_cfg.qwen["vocab_size"])
    build_tokenizer(tok_dir, max_vocab=min(text_vocab, 1024))
    (tok_dir / "config.json").write_text(json.dumps(dict(llm_cfg.qwen), indent=2) + "\n")
    say(f"{TOKENIZER_DIR}/: Qwen2 config (vocab {text_vocab}) + stand-in tokenizer")

    write_yaml(out / "cosyvoice2.yaml", llm_cfg, flow_cfg, hift_cfg,
               header=f"Random-weight CosyVoice2 checkpoint ({size}, seed {seed}) written by "
                      "`tts-gateway make-checkpoint`;\nsame layout as the released CosyVoice2-0.5B directory.")
    say("cosyvoice2.yaml")

    for kind, cfg in (("hift", hift_cfg), ("flow", flow_cfg), ("llm", llm_cfg)) if weights else ():
        module = _build_module(kind, cfg, seed)
        n = _save_state_dict(module, out / f"{kind}.pt")
        del module
        say(f"{kind}.pt: {n / 1e6:.1f} M parameters")

    build_speech_tokenizer_onnx(out / "speech_tokenizer_v2.onnx", seed)
    build_campplus_onnx(out / "campplus.onnx", seed)
    say("speech_tokenizer_v2.onnx, campplus.onnx")
    (out / "README.md").write_text(
        f"# Random-weight CosyVoice2 model directory ({size})\n\n"
        "Written by `tts-gateway make-checkpoint` for tests and benchmarks. It has the file layout,\n"
        "state-dict keys, shapes and ONNX interfaces of the released CosyVoice2-0.5B directory, but\n"
        "random weights, stand-in ONNX graphs and a small stand-in tokenizer: it speaks noise.\n"
    )
    return out


def main_make_checkpoint(argv: Sequence[str] | None = None) -> int:
    """``tts-gateway make-checkpoint [--size full|tiny] [--seed N] [--force] OUT``."""
    parser = argparse.ArgumentParser(
        prog="tts-gateway make-checkpoint",
        description="Write a random-weight CosyVoice2 model directory in the official layout "
                    "(for tests and benchmarks; it produces noise, not speech).",
    )
    parser.add_argument("out", help="directory to write (created if missing)")
    parser.add_argument("--size", choices=SIZES, default="tiny",
                        help="full: CosyVoice2-0.5B sizes (~2.4 GB); tiny: a few MB for CPU tests")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--force", action="store_true", help="write into a non-empty directory")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.force:
        print(f"{out} is not empty; use --force to overwrite", file=sys.stderr)
        return 2
    make_checkpoint(out, args.size, args.seed, log=lambda m: print(m, file=sys.stderr))
    print(out)
    return 0
