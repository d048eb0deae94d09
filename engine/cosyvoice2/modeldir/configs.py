"""The typed configuration of a CosyVoice2 model directory: plain dataclasses, no torch.

Each class holds the constructor arguments of one official module, as ``cosyvoice2.yaml``
names them (``OFFICIAL_TARGET``), with CosyVoice2-0.5B's values as defaults; ``tiny()``
gives the small sizes the tests run. The model layer builds its modules from these, and
:mod:`tts_gateway.engine.cosyvoice2.modeldir.reading` fills them from a directory's yaml.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


# ----------------------------------------------------------------------------- LLM


@dataclass(frozen=True)
class SamplingConfig:
    """The ``ras_sampling`` arguments of the model yaml (``llm.sampling``)."""

    OFFICIAL_TARGET: ClassVar[str] = "cosyvoice.utils.common.ras_sampling"

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1


# Qwen2.5-0.5B, the backbone CosyVoice-BlankEN/config.json describes; used without a model directory.
QWEN2_5_0_5B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


@dataclass(frozen=True)
class LLMConfig:
    """The ``llm: !new:cosyvoice.llm.llm.Qwen2LM`` kwargs of ``cosyvoice2.yaml``, plus the backbone.

    ``length_normalized_loss`` and ``lsm_weight`` only matter for training; they are kept
    so that every yaml kwarg has a field of the same name.
    """

    OFFICIAL_TARGET: ClassVar[str] = "cosyvoice.llm.llm.Qwen2LM"

    llm_input_size: int = 896
    llm_output_size: int = 896
    speech_token_size: int = 6561
    length_normalized_loss: bool = True
    lsm_weight: float = 0.0
    mix_ratio: tuple[int, int] = (5, 15)
    sampling: SamplingConfig = SamplingConfig()
    # The backbone: the fields of CosyVoice-BlankEN/config.json.
    # (Not a constructor argument in the yaml: config.json beside it describes the backbone.)
    qwen: Mapping[str, Any] = field(default_factory=lambda: dict(QWEN2_5_0_5B), metadata={"yaml": False})

    @classmethod
    def full(cls, model_dir: str | Path | None = None, **yaml_kwargs: Any) -> LLMConfig:
        """CosyVoice2-0.5B; with ``model_dir``, the backbone is read from its CosyVoice-BlankEN/config.json."""
        qwen = dict(QWEN2_5_0_5B)
        if model_dir is not None:
            qwen = json.loads((Path(model_dir) / "CosyVoice-BlankEN" / "config.json").read_text())
        return cls(qwen=qwen, **yaml_kwargs)

    @classmethod
    def tiny(cls) -> LLMConfig:
        """A few-MB model for tests; text ids < 1024, the real speech vocabulary."""
        qwen = dict(QWEN2_5_0_5B)
        qwen.update(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            max_window_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1024,
            bos_token_id=None,
            eos_token_id=None,
        )
        return cls(llm_input_size=64, llm_output_size=64, qwen=qwen)

    @property
    def vocab(self) -> UnifiedVocab:
        return UnifiedVocab(int(self.qwen["vocab_size"]), self.speech_token_size)


@dataclass(frozen=True)
class UnifiedVocab:
    """One id space for everything the LLM reads, so that a backend can take token ids only.

    With ``T = text_vocab_size`` and ``S = speech_token_size``:

    ====================  ===========================  =====================
    unified id            meaning                      embedding row
    ====================  ===========================  =====================
    ``[0, T)``            text token t                 ``embed_tokens[t]``
    ``T``                 ``sos_eos``                  ``llm_embedding[0]``
    ``T + 1``             ``task_id``                  ``llm_embedding[1]``
    ``T + 2 + c``         speech class c in [0, S+3)   ``speech_embedding[c]``
    ====================  ===========================  =====================

    Speech classes are also what the head (``llm_decoder``) scores: ``c < S`` is a speech
    token, ``S`` is eos, ``S + 1`` is unused, ``S + 2`` is fill ("give me more text").
    A backend whose sampler must return unified ids (vLLM) maps class c to ``T + 2 + c``
    and gives the ``T + 2`` non-speech ids no probability.
    """

    text_vocab_size: int
    speech_token_size: int

    @property
    def sos_eos(self) -> int:
        return self.text_vocab_size

    @property
    def task_id(self) -> int:
        return self.text_vocab_size + 1

    @property
    def speech_offset(self) -> int:
        return self.text_vocab_size + 2

    @property
    def num_speech_classes(self) -> int:
        return self.speech_token_size + 3

    @property
    def size(self) -> int:
        return self.speech_offset + self.num_speech_classes

    @property
    def eos_class(self) -> int:
        return self.speech_token_size

    @property
    def fill_class(self) -> int:
        return self.speech_token_size + 2

    def speech(self, speech_class: int) -> int:
        """The unified id of a speech class (a speech token, eos, or fill)."""
        if not 0 <= speech_class < self.num_speech_classes:
            raise ValueError(f"speech class {speech_class} is outside [0, {self.num_speech_classes})")
        return self.speech_offset + speech_class

    def speech_class(self, unified_id: int) -> int:
        """The speech class of a unified id; ValueError for text and special ids."""
        if not self.speech_offset <= unified_id < self.size:
            raise ValueError(f"unified id {unified_id} is not a speech id")
        return unified_id - self.speech_offset

    def text(self, token_ids: Iterable[int]) -> list[int]:
        """Text token ids as unified ids (the same numbers, range-checked)."""
        ids = [int(t) for t in token_ids]
        for t in ids:
            if not 0 <= t < self.text_vocab_size:
                raise ValueError(f"text token {t} is outside [0, {self.text_vocab_size})")
        return ids


# ----------------------------------------------------------------------------- flow


@dataclass
class FlowEncoderConfig:
    """Constructor arguments of the official ``UpsampleConformerEncoder``; defaults are CosyVoice2-0.5B's.

    Dropout rates are kept so a yaml round-trips; inference ignores them.
    """

    OFFICIAL_TARGET: ClassVar[str] = "cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder"

    output_size: int = 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    dropout_rate: float = 0.1
    positional_dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    normalize_before: bool = True
    input_layer: str = "linear"
    pos_enc_layer_type: str = "rel_pos_espnet"
    selfattention_layer_type: str = "rel_selfattn"
    input_size: int = 512
    use_cnn_module: bool = False
    macaron_style: bool = False
    static_chunk_size: int = 25

    @classmethod
    def full(cls) -> FlowEncoderConfig:
        """CosyVoice2-0.5B (cosyvoice2.yaml)."""
        return cls()

    @classmethod
    def tiny(cls) -> FlowEncoderConfig:
        """Test size: narrow and shallow, the real chunk size."""
        return cls(output_size=64, attention_heads=4, linear_units=128, num_blocks=2, input_size=64)

    def check_supported(self) -> None:
        """Only the variant CosyVoice2 uses is implemented; refuse others loudly."""
        wanted = {
            "input_layer": "linear",
            "pos_enc_layer_type": "rel_pos_espnet",
            "selfattention_layer_type": "rel_selfattn",
            "normalize_before": True,
            "use_cnn_module": False,
            "macaron_style": False,
        }
        for name, value in wanted.items():
            if getattr(self, name) != value:
                raise ValueError(f"flow encoder: {name}={getattr(self, name)!r} is not supported (only {value!r})")
        if self.input_size != self.output_size:
            # up_embed applies a Linear(input_size, ...) to output_size-wide frames.
            raise ValueError("flow encoder: input_size must equal output_size")
        if self.output_size % self.attention_heads:
            raise ValueError("flow encoder: output_size must be a multiple of attention_heads")


@dataclass
class EstimatorConfig:
    """Constructor arguments of the official ``CausalConditionalDecoder``; defaults are CosyVoice2-0.5B's."""

    OFFICIAL_TARGET: ClassVar[str] = "cosyvoice.flow.decoder.CausalConditionalDecoder"

    in_channels: int = 320  # x, mu, spk, cond: 4 x 80
    out_channels: int = 80
    channels: list[int] = field(default_factory=lambda: [256])
    dropout: float = 0.0  # training only
    attention_head_dim: int = 64
    n_blocks: int = 4
    num_mid_blocks: int = 12
    num_heads: int = 8
    act_fn: str = "gelu"
    static_chunk_size: int = 50  # frames: 25 tokens x token_mel_ratio 2
    # The official mask helper ignores this (all left chunks are always visible); so do we.
    num_decoding_left_chunks: int = -1

    @classmethod
    def full(cls) -> EstimatorConfig:
        return cls()

    @classmethod
    def tiny(cls) -> EstimatorConfig:
        """Test size; the real mel width, chunk size and layer types."""
        return cls(channels=[32], attention_head_dim=16, n_blocks=1, num_mid_blocks=2, num_heads=2)


@dataclass
class CFMParams:
    """The official ``cfm_params`` mapping (an ``omegaconf.DictConfig`` built from ``content:``)."""

    sigma_min: float = 1e-06
    solver: str = "euler"
    t_scheduler: str = "cosine"
    training_cfg_rate: float = 0.2  # training only
    inference_cfg_rate: float = 0.7
    reg_loss_type: str = "l1"  # training only


@dataclass
class CFMConfig:
    """Constructor arguments of the official ``CausalConditionalCFM``."""

    OFFICIAL_TARGET: ClassVar[str] = "cosyvoice.flow.flow_matching.CausalConditionalCFM"

    in_channels: int = 240  # unused at inference, kept for the yaml
    n_spks: int = 1
    spk_emb_dim: int = 80
    cfm_params: CFMParams = field(default_factory=CFMParams)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)

    @classmethod
    def full(cls) -> CFMConfig:
        return cls()

    @classmethod
    def tiny(cls) -> CFMConfig:
        return cls(estimator=EstimatorConfig.tiny())


@dataclass
class FlowConfig:
    """Constructor arguments of the official ``CausalMaskedDiffWithXvec``; defaults are CosyVoice2-0.5B's."""

    OFFICIAL_TARGET: ClassVar[str] = "cosyvoice.flow.flow.CausalMaskedDiffWithXvec"

    input_size: int = 512  # token embedding width (= the encoder's input_size)
    output_size: int = 80  # mel bins
    spk_embed_dim: int = 192
    output_type: str = "mel"
    vocab_size: int = 6561
    input_frame_rate: int = 25  # tokens per second
    only_mask_loss: bool = True  # training only
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    encoder: FlowEncoderConfig = field(default_factory=FlowEncoderConfig)
    decoder: CFMConfig = field(default_factory=CFMConfig)

    @classmethod
    def full(cls) -> FlowConfig:
        """CosyVoice2-0.5B (cosyvoice2.yaml): 112.5 M parameters."""
        return cls()

    @classmethod
    def tiny(cls) -> FlowConfig:
        """Test size. The encoder stays 512 wide: the official one hard-codes 512 channels
        in its look-ahead and upsampling convs, and the tests compare against it."""
        encoder = dataclasses.replace(FlowEncoderConfig.tiny(), input_size=512, output_size=512)
        return cls(vocab_size=100, encoder=encoder, decoder=CFMConfig.tiny())


# ----------------------------------------------------------------------------- HiFT


@dataclass
class F0PredictorConfig:
    """Constructor arguments of the official ``ConvRNNF0Predictor``."""

    OFFICIAL_TARGET: ClassVar[str] = "cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor"

    num_class: int = 1
    in_channels: int = 80
    cond_channels: int = 512


@dataclass
class HiFTConfig:
    """Constructor arguments of the official ``HiFTGenerator``; defaults are CosyVoice2-0.5B's."""

    OFFICIAL_TARGET: ClassVar[str] = "cosyvoice.hifigan.generator.HiFTGenerator"

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10
    upsample_rates: list[int] = field(default_factory=lambda: [8, 5, 3])
    upsample_kernel_sizes: list[int] = field(default_factory=lambda: [16, 11, 7])
    istft_params: dict[str, int] = field(default_factory=lambda: {"n_fft": 16, "hop_len": 4})
    resblock_kernel_sizes: list[int] = field(default_factory=lambda: [3, 7, 11])
    resblock_dilation_sizes: list[list[int]] = field(default_factory=lambda: [[1, 3, 5], [1, 3, 5], [1, 3, 5]])
    source_resblock_kernel_sizes: list[int] = field(default_factory=lambda: [7, 7, 11])
    source_resblock_dilation_sizes: list[list[int]] = field(
        default_factory=lambda: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    )
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_predictor: F0PredictorConfig = field(default_factory=F0PredictorConfig)

    @classmethod
    def full(cls) -> HiFTConfig:
        """CosyVoice2-0.5B (cosyvoice2.yaml): 20.8 M parameters."""
        return cls()

    @classmethod
    def tiny(cls) -> HiFTConfig:
        """Test size: narrow channels, the real rates, so one frame is still 480 samples."""
        return cls(base_channels=32, f0_predictor=F0PredictorConfig(cond_channels=32))

    @property
    def n_fft(self) -> int:
        return self.istft_params["n_fft"]

    @property
    def hop_len(self) -> int:
        return self.istft_params["hop_len"]

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsample_rates) * self.hop_len


# ----------------------------------------------------------------------------- frontend


@dataclass
class FrontendConfig:
    """What the frontend reads from the yaml (``get_tokenizer``, ``allowed_special``, ``feat_extractor``)."""

    tokenizer_path: str = ""
    skip_special_tokens: bool = True
    allowed_special: str = "all"
    # matcha.utils.audio.mel_spectrogram arguments (the prompt mel)
    n_fft: int = 1920
    num_mels: int = 80
    sampling_rate: int = 24000
    hop_size: int = 480
    win_size: int = 1920
    fmin: float = 0
    fmax: float | None = 8000
    center: bool = False
