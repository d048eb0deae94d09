"""CosyVoice2 flow: speech tokens -> 80-bin mel at 50 Hz, by conditional flow matching.

Pipeline (all of it loads the released ``flow.pt`` strictly; parameter names and shapes
are those of the official ``CausalMaskedDiffWithXvec``):

1. the token encoder (``flow_encoder.py``) turns prompt tokens + new tokens into ``mu``,
   one 80-dim vector per mel frame (2 frames a token), and projects the speaker x-vector
   to 80 dims;
2. the decoder (``cfm.py``) integrates from noise to mel with 10 Euler steps (or
   ``n_timesteps``), conditioned
   on ``mu``, the speaker and ``cond``: the prompt mel in the prompt frames and zeros
   elsewhere, so that the model continues the prompt's voice;
3. the velocity network it integrates is the ``estimator.py`` U-Net.

:meth:`Flow.inference_batch` is the official ``inference`` on a batch of rows.
:meth:`Flow.decoder_inputs` is its first half, so that the serving layer can run the
decoder its own way (a CUDA graph, or only the frames after a voice's stored prefix) and
cut each row's new frames out with :meth:`Flow.new_frames`.

Chunk-causality
---------------
In streaming mode the estimator's attention is chunk-causal: frame i sees frames
j < (i // 50 + 1) * 50 (static_chunk_size 50 frames = 25 tokens, all left chunks), and
every convolution is causal (kernel 3, left padding), everything else is per frame. The
Euler update is per frame too, and the unconditional CFG row has the same structure.
So at every step, x_t of frames before a chunk boundary S depends only on frames
before S: noise (always the same prefix of one fixed tensor), mu, cond and spk. The
token encoder is chunk-causal with the same boundaries (25 tokens -> 50 frames; its
3-token lookahead uses tokens that are then final). Hence, when tokens are appended,
the outputs of all frames before the last complete 50-frame chunk stay the same, in
every step and in the final mel. The serving layer builds on that twice: a voice's
prompt chunks are solved once and shared (serving/prefix_bank.py), and an utterance may
keep its committed chunks' state instead of re-running them (serving/incremental.py).

Measured on the tiny model (random weights, float32, mel values up to ~5; tests in
tests/engine/cosyvoice2/model/test_flow.py):

- decoder alone, 100 vs 150 frames (streaming): estimator output / final mel of the
  2 complete chunks differ by 1.4e-6 / 9.5e-7, float rounding of differently shaped
  matmuls, i.e. identical; with 120 vs 150 frames the shorter run's partial chunk
  (frames 100..119, which gain keys in their own chunk) differs by 8.7e-2 / 1.0e-1;
- the official whole flow, 25 prompt tokens + 50 or 62 vs 87 new tokens (streaming,
  finalize=False): complete chunks 1.4e-6, the partial chunk 6.4e-2;
- non-streaming mode (full attention): every frame changes, 0.11..0.32; no reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tts_gateway.engine.cosyvoice2.model.cfm import CFM, N_TIMESTEPS
from tts_gateway.engine.cosyvoice2.model.flow_encoder import build_token_encoder_parts, encode_tokens
from tts_gateway.engine.cosyvoice2.modeldir.configs import FlowConfig


def gather_frames(x: Tensor, start: Tensor, frames: int) -> Tensor:
    """``[B, C, T]`` -> ``[B, C, frames]``: row b's columns start[b], start[b] + 1, ... (clamped to T - 1)."""
    columns = (start[:, None] + torch.arange(frames, device=x.device)).clamp(max=max(x.shape[2] - 1, 0))
    return x.gather(2, columns[:, None, :].expand(-1, x.shape[1], -1))


@dataclass(frozen=True)
class DecoderInputs:
    """What the decoder solves for one batch of rows, and where each row's new frames lie.

    ``mu``, ``cond`` ``[B, 80, T]``, ``mask`` ``[B, 1, T]``, ``spk`` ``[B, 80]``: the
    decoder's inputs for T frames; ``offset`` ``[B]``: the column of each row's first new
    frame (the prompt's frames come before it); ``new_len`` ``[B]``: its new frames.
    """

    mu: Tensor
    mask: Tensor
    spk: Tensor
    cond: Tensor
    offset: Tensor
    new_len: Tensor


@dataclass(frozen=True)
class EncodedTokens:
    """The token encoder's output for a batch of rows: row b's ``mu`` column i is mel frame
    first[b] + i (frames counted from the start of the prompt), up to frame end[b]; ``spk``
    ``[B, 80]``. A whole encode starts at frame 0; an incremental one after the frames it has
    kept (serving/incremental_encoder.py)."""

    mu: Tensor
    first: Tensor
    end: Tensor
    spk: Tensor


class Flow(nn.Module):
    """Speech tokens + prompt (tokens, mel, x-vector) -> mel of the new tokens; loads ``flow.pt`` strictly."""

    def __init__(self, config: FlowConfig) -> None:
        super().__init__()
        if config.input_size != config.encoder.input_size:
            raise ValueError("input_size must equal encoder.input_size")
        self.config = config
        parts = build_token_encoder_parts(config.encoder, config.vocab_size, config.output_size, config.spk_embed_dim)
        self.input_embedding = parts["input_embedding"]
        self.spk_embed_affine_layer = parts["spk_embed_affine_layer"]
        self.encoder = parts["encoder"]
        self.encoder_proj = parts["encoder_proj"]
        self.decoder = CFM(config.decoder)

    @torch.inference_mode()
    def inference(
        self,
        token: Tensor,
        token_len: Tensor,
        prompt_token: Tensor,
        prompt_token_len: Tensor,
        prompt_feat: Tensor,
        prompt_feat_len: Tensor,
        embedding: Tensor,
        streaming: bool,
        finalize: bool,
        noise: Tensor | None = None,
        n_timesteps: int = N_TIMESTEPS,
    ) -> Tensor:
        """Mel ``[B, 80, T_new]`` of the new tokens (prompt frames cut off), as the official ``inference``
        (whose decoder always takes 10 Euler steps; ``n_timesteps`` may ask for others).

        For B > 1 rows are zero-padded on the right; ``inference_batch`` also gives their lengths.
        """
        return self.inference_batch(
            token, token_len, prompt_token, prompt_token_len, prompt_feat, prompt_feat_len, embedding, streaming,
            finalize, noise, n_timesteps,
        )[0]

    @torch.inference_mode()
    def inference_batch(
        self,
        token: Tensor,
        token_len: Tensor,
        prompt_token: Tensor,
        prompt_token_len: Tensor,
        prompt_feat: Tensor,
        prompt_feat_len: Tensor,
        embedding: Tensor,
        streaming: bool,
        finalize: bool | Tensor,
        noise: Tensor | None = None,
        n_timesteps: int = N_TIMESTEPS,
    ) -> tuple[Tensor, Tensor]:
        """Batched ``inference``: every row equals running it alone.

        Arguments as :meth:`decoder_inputs`; noise: ``[1 or B, 80, >= frames]`` (default: the
        official fixed noise); n_timesteps: the decoder's Euler steps. Returns mel
        ``[B, 80, max new frames]`` (float32) and the new frame counts ``[B]``.
        """
        inputs = self.decoder_inputs(
            token, token_len, prompt_token, prompt_token_len, prompt_feat, prompt_feat_len, embedding, streaming,
            finalize,
        )
        mel = self.decoder(inputs.mu, inputs.mask, inputs.spk, inputs.cond, streaming, noise, n_timesteps)
        return self.new_frames(mel, inputs), inputs.new_len

    def decoder_inputs(
        self,
        token: Tensor,
        token_len: Tensor,
        prompt_token: Tensor,
        prompt_token_len: Tensor,
        prompt_feat: Tensor,
        prompt_feat_len: Tensor,
        embedding: Tensor,
        streaming: bool,
        finalize: bool | Tensor,
        start: Tensor | None = None,
        encoding: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> DecoderInputs:
        """The decoder's inputs for a batch: the token encoder's output and the conditions.

        token ``[B, N]`` / token_len ``[B]``; prompt_token ``[B, P]`` / prompt_token_len;
        prompt_feat ``[B, Tp, 80]`` / prompt_feat_len (= 2 x prompt tokens); embedding
        ``[B, 192]``. finalize (one flag, or one per row): where False, the last
        ``pre_lookahead_len`` tokens are held back as look-ahead. start ``[B]`` (streaming
        only): the inputs of the frames from ``start[b]`` on (a voice prefix's end: row b's
        column i is frame start[b] + i); None: of every frame. encoding: the token encoder's
        output (mu, mel_len, spk) for these arguments where the caller computed it.
        """
        config = self.config
        if encoding is None:
            encoding = encode_tokens(
                self, token, token_len, prompt_token, prompt_token_len, embedding, streaming, finalize,
                config.pre_lookahead_len, config.token_mel_ratio,
            )
        mu, mel_len, spk = encoding
        if start is None:
            prompt_feat_len = prompt_feat_len.to(mu.device)
            frames = mu.shape[2]
            mask = (torch.arange(frames, device=mu.device) < mel_len[:, None])[:, None].to(mu.dtype)
            cond = self.prompt_condition(prompt_feat, prompt_feat_len, torch.zeros_like(prompt_feat_len), frames)
            return DecoderInputs(mu, mask, spk, cond, prompt_feat_len, (mel_len - prompt_feat_len).clamp(min=0))
        if not streaming:
            raise ValueError("only a streaming call can start after earlier frames")
        encoded = EncodedTokens(mu, torch.zeros_like(mel_len), mel_len, spk)
        return self.inputs_after(encoded, prompt_feat, prompt_feat_len, start)

    def inputs_after(
        self, encoded: EncodedTokens, prompt_feat: Tensor, prompt_feat_len: Tensor, start: Tensor,
        width: int | None = None,
    ) -> DecoderInputs:
        """A streaming call's decoder inputs for the frames from ``start[b]`` on, from the token
        encoder's output ``encoded``, which holds them (``encoded.first`` <= ``start``).
        ``width``: the most frames of a row, ``max(end - start)``, where the caller counted it
        (else it is read from the device, which waits for the encoder's work)."""
        mu, end = encoded.mu, encoded.end
        prompt_feat_len = prompt_feat_len.to(mu.device)
        if width is None:
            width = int((end - start).max())
        mask = (torch.arange(width, device=mu.device) < (end - start)[:, None])[:, None].to(mu.dtype)
        cond = self.prompt_condition(prompt_feat, prompt_feat_len, start, width)
        mu = gather_frames(mu, start - encoded.first, width) * mask
        return DecoderInputs(mu, mask, encoded.spk, cond, prompt_feat_len - start, (end - prompt_feat_len).clamp(min=0))

    def new_frames(self, mel: Tensor, inputs: DecoderInputs) -> Tensor:
        """Each row's new frames of the decoder's ``mel``, left-aligned and zero-padded."""
        return self.cut_rows(mel, inputs.offset, inputs.new_len)

    def voice_prefix_frames(self, prompt_tokens: int) -> int:
        """The frames of a prompt of this many tokens that every streaming call of its voice
        computes the same: its whole chunks whose tokens and look-ahead are all prompt tokens
        (serving/prefix_bank.py stores their decoder state)."""
        config = self.config
        chunk_tokens = config.encoder.static_chunk_size
        return max(0, prompt_tokens - config.pre_lookahead_len) // chunk_tokens * chunk_tokens * config.token_mel_ratio

    def prompt_condition(self, prompt_feat: Tensor, prompt_feat_len: Tensor, start: Tensor, frames: int) -> Tensor:
        """``cond`` ``[B, 80, frames]`` for frames start[b] + i: the prompt mel where there is one, else 0."""
        feat = prompt_feat.transpose(1, 2).to(self.encoder_proj.weight.dtype)
        if feat.shape[2] == 0:
            return feat.new_zeros(feat.shape[0], feat.shape[1], frames)
        positions = start[:, None] + torch.arange(frames, device=feat.device)
        inside = (positions < prompt_feat_len[:, None])[:, None, :]
        return gather_frames(feat, start, frames) * inside

    @staticmethod
    def cut_rows(mel: Tensor, offset: Tensor, length: Tensor) -> Tensor:
        """Row b's columns offset[b] .. offset[b] + length[b] - 1, left-aligned and zero-padded."""
        width = int(length.max()) if length.numel() else 0
        rows = gather_frames(mel, offset, width)
        return rows * (torch.arange(width, device=mel.device) < length[:, None])[:, None, :]
