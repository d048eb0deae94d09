"""Incremental streaming: an utterance keeps its flow state, so a chunk computes its own frames.

The official way of streaming re-runs the whole flow over prompt + all tokens so far for
every 25-token chunk, so chunk k costs O(k). Chunk-causality (see engine/cosyvoice2/model/
flow.py) makes that replaceable, exactly, by an incremental run that keeps, per Euler step
and CFG row, the attention keys/values and the 2-frame causal-conv left context of the
committed frames (whole 50-frame chunks), and computes only the frames from the last chunk
boundary on; the token encoder streams the same way (``flow_encoder.IncrementalEncoder``).

:func:`inference_chunk` against the official full re-run, streamed chunk by chunk (the
official padded-first-hop chunking, arbitrary hop sizes, empty prompt, two sessions
batched): max abs diff <= 2.4e-6 (tests/engine/cosyvoice2/serving/test_incremental.py).

Cost of the state: per committed frame and per Euler step and CFG row it holds K and V of
every attention layer (56 layers x 2 x 512 values at full size), so with the official 10
steps 10 x 2 rows x 56 x 1024 x 4 bytes = 4.6 MB per frame in float32 (2.3 MB in bf16):
about 3 GB (1.5 GB) for 3 s of prompt + 10 s of speech. The state is laid out for the
cache's step count (the ``flow_steps`` setting) and scales with it. ``flow_mode =
"incremental"`` (CPU default) uses it; a GPU recomputes and shares voice prefixes instead
(prefix_bank.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tts_gateway.engine.cosyvoice2.model.cfm import CFM, N_TIMESTEPS
from tts_gateway.engine.cosyvoice2.model.estimator import SelfAttention, attend_over_stored, chunk_attention_mask
from tts_gateway.engine.cosyvoice2.model.flow import Flow, gather_frames
from tts_gateway.engine.cosyvoice2.model.flow_encoder import project_speaker
from tts_gateway.engine.cosyvoice2.serving.incremental_encoder import EncoderStreamState, IncrementalEncoder


class CFMStreamCache:
    """Decoder state of streaming sessions (``forward_chunk``): what committed frames leave behind.

    For every Euler step and every CFG row (cond rows then uncond rows, ``2B`` in all) it
    keeps the attention keys/values of the committed frames and, for every causal
    convolution, its input at the last ``kernel - 1`` committed frames. Committed frames
    are whole 50-frame chunks (prompt included) whose states no later token can change.

    Rows are sessions; every call must pass the same sessions in the same order.
    Storage is allocated on the first call and grows by whole chunks. ``steps``: the Euler
    steps every solve over this cache takes (the state of one step is no other step's).
    """

    def __init__(self, steps: int = N_TIMESTEPS) -> None:
        self.steps = steps
        self.committed: list[int] = []  # per session: frames whose states are stored
        self.capacity = 0  # frames the key/value buffers can hold
        self.keys: list[Tensor] = []  # [step * n_attention + layer] -> [2B, heads, capacity, head_dim]
        self.values: list[Tensor] = []
        self.conv_context: list[Tensor] = []  # [step * n_conv + conv] -> [2B, channels, kernel - 1]

    @property
    def started(self) -> bool:
        return bool(self.committed)


class StepView:
    """The cache as one estimator call sees it: one Euler step, new frames at per-row offsets.

    start: ``[2B]`` first new frame of each row (its committed count, a chunk boundary);
    commit: ``[2B]`` how many of the new frames this call commits; key_len: keys to
    attend over (max of start + new frames).
    """

    keeps_inputs = False

    def __init__(
        self,
        cache: CFMStreamCache,
        step: int,
        start: Tensor,
        commit: Tensor,
        key_len: int,
        n_attention: int,
        n_conv: int,
    ) -> None:
        self.cache = cache
        self.start = start
        self.commit = commit
        self.key_len = key_len
        self.attention_base = step * n_attention
        self.conv_base = step * n_conv

    def conv_input(self, slot: int, x: Tensor) -> Tensor:
        """``x`` with its stored left context prepended; stores the context for the next call."""
        index = self.conv_base + slot
        extended = torch.cat([self.cache.conv_context[index], x], dim=2)
        context = self.cache.conv_context[index].shape[2]
        # extended[:, :, e] is frame start - context + e, so the frames just before
        # start + commit are extended[:, :, commit : commit + context].
        take = self.commit[:, None, None] + torch.arange(context, device=x.device)
        self.cache.conv_context[index] = extended.gather(2, take.expand(-1, x.shape[1], -1))
        return extended

    def attention_mask(self, new_frames: Tensor, positions: Tensor, chunk: int) -> Tensor:
        """The chunk mask of the new frames (queries) over the cached and new frames (keys)."""
        key_pos = torch.arange(self.key_len, device=positions.device)
        key_valid = key_pos < (self.start + new_frames)[:, None]
        return chunk_attention_mask(key_valid, self.start[:, None] + positions, chunk)

    def attend(self, slot: int, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None) -> Tensor:
        return attend_over_stored(self, slot, query, key, value, mask)

    def keys_values(self, slot: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Writes the new frames' keys/values at their absolute positions; returns all of them.

        Positions past a row's committed frames are scratch: masked out now and
        overwritten by the next call.
        """
        index = self.attention_base + slot
        positions = self.start[:, None] + torch.arange(key.shape[2], device=key.device)
        positions = positions[:, None, :, None].expand_as(key)
        self.cache.keys[index].scatter_(2, positions, key)
        self.cache.values[index].scatter_(2, positions, value)
        return self.cache.keys[index][:, :, : self.key_len], self.cache.values[index][:, :, : self.key_len]


class FlowStreamCache:
    """State of a group of streaming sessions for ``inference_chunk`` (row b = session b).

    Holds each session's incremental token-encoder state, the decoder's per-step cache,
    how many tokens (prompt included) were consumed and how many mel frames (prompt
    included) were returned. Every call passes the same sessions in the same order;
    the decoder solves with ``steps`` Euler steps.
    """

    def __init__(self, steps: int = N_TIMESTEPS) -> None:
        self.encoder: list[EncoderStreamState] = []
        self.decoder = CFMStreamCache(steps)
        self.tokens_seen: list[int] = []
        self.emitted: list[int] = []

    @property
    def started(self) -> bool:
        return bool(self.encoder)


def zero_conv_context(cfm: CFM, rows: int, like: Tensor, steps: int) -> list[Tensor]:
    """Every causal conv's left context at the start of a sequence (its zero padding), for
    each of ``steps`` Euler steps: ``[step * n_conv + conv]`` -> ``[rows, channels, kernel - 1]``."""
    return [
        like.new_zeros(rows, conv.in_channels, conv.context)
        for _ in range(steps)
        for conv in cfm.estimator.causal_convs
    ]


def allocate_cache(cfm: CFM, cache: CFMStreamCache, sessions: int, frames: int, like: Tensor) -> None:
    """Grows ``cache`` (``sessions`` rows) so it can hold ``frames`` frames; keeps its contents."""
    chunk = cfm.config.estimator.static_chunk_size
    rows = 2 * sessions
    if not cache.started:
        cache.committed = [0] * sessions
        cache.conv_context = zero_conv_context(cfm, rows, like, cache.steps)
    elif len(cache.committed) != sessions:
        raise ValueError(f"cache holds {len(cache.committed)} sessions, call has {sessions}")
    if frames <= cache.capacity:
        return
    capacity = -(-frames // chunk) * chunk + 2 * chunk  # whole chunks, with room for two more

    def grown(old: Tensor | None, layer: SelfAttention) -> Tensor:
        new = like.new_zeros(rows, layer.heads, capacity, layer.head_dim)
        if old is not None:
            new[:, :, : cache.capacity] = old
        return new

    layers = cfm.estimator.attention_layers * cache.steps
    old_keys = cache.keys or [None] * len(layers)
    old_values = cache.values or [None] * len(layers)
    cache.keys = [grown(old, layer) for old, layer in zip(old_keys, layers)]
    cache.values = [grown(old, layer) for old, layer in zip(old_values, layers)]
    cache.capacity = capacity


def forward_chunk(
    cfm: CFM,
    cache: CFMStreamCache,
    mu: Tensor,
    mask: Tensor,
    spks: Tensor,
    cond: Tensor,
    noise: Tensor,
    start: list[int],
    commit: list[int],
) -> Tensor:
    """Mel of new frames only (streaming mode, ``cache.steps`` Euler steps: the steps its state
    is kept for), reusing and extending ``cache``.

    mu, cond, noise: ``[B, 80, n]`` for the new frames, row b's frame i being frame
    ``start[b] + i`` of the sequence; mask ``[B, 1, n]``; ``start[b]`` must equal the
    cache's committed count; ``commit[b]`` (a multiple of the chunk size, or 0) new
    frames become committed.
    """
    if list(start) != (cache.committed if cache.started else [0] * len(start)):
        raise ValueError(f"new frames start at {start}, cache has {cache.committed} committed")
    sessions, _, frames = mu.shape
    allocate_cache(cfm, cache, sessions, max(start) + frames, mu)
    new_frames = mask[:, 0].sum(dim=1).tolist()
    key_len = max(s + int(n) for s, n in zip(start, new_frames))
    start_rows = torch.tensor(start + start, device=mu.device)
    commit_rows = torch.tensor(commit + commit, device=mu.device)
    n_attention = len(cfm.estimator.attention_layers)
    n_conv = len(cfm.estimator.causal_convs)

    def view_for_step(step: int) -> StepView:
        return StepView(cache, step, start_rows, commit_rows, key_len, n_attention, n_conv)

    mel = cfm.solve(noise.to(mu.dtype), mask, mu, spks, cond, True, cache.steps, view_for_step)
    cache.committed = [s + c for s, c in zip(start, commit)]
    return mel


@torch.inference_mode()
def inference_chunk(
    flow: Flow,
    cache: FlowStreamCache,
    token: Tensor,
    token_len: Tensor,
    prompt_token: Tensor,
    prompt_token_len: Tensor,
    prompt_feat: Tensor,
    prompt_feat_len: Tensor,
    embedding: Tensor,
    finalize: bool,
    noise: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Streaming step that computes only frames not already final: the exact replacement of
    re-running ``inference(..., streaming=True)`` on all tokens so far for every chunk.

    Arguments as ``Flow.inference_batch`` (``token`` = all tokens so far, growing from call to
    call); the decoder takes the cache's Euler steps (``FlowStreamCache(steps)``). Returns
    the mel frames not returned before, ``[B, 80, max n]``, and n ``[B]``: equal to the
    official full re-run's new-token mel from the previous call's end on. Encoder and
    decoder each keep the states of complete 25-token / 50-frame chunks and recompute only
    from the last chunk boundary (see the module docstring).
    """
    config = flow.config
    chunk = config.decoder.estimator.static_chunk_size
    if chunk <= 0 or chunk != config.encoder.static_chunk_size * config.token_mel_ratio:
        raise ValueError("incremental streaming needs the decoder's chunk = the encoder's chunk in mel frames")
    sessions = token.shape[0]
    device = token.device
    if not cache.started:
        cache.encoder = [EncoderStreamState() for _ in range(sessions)]
        cache.tokens_seen = [0] * sessions
        cache.emitted = [int(n) for n in prompt_feat_len.tolist()]
    elif len(cache.encoder) != sessions:
        raise ValueError(f"cache holds {len(cache.encoder)} sessions, call has {sessions}")
    if any(state.finished for state in cache.encoder):
        raise ValueError("a finalized stream was continued")

    # 1. tokens: only the ones each session has not consumed yet
    new_tokens = []
    for row, (n_prompt, n_token) in enumerate(zip(prompt_token_len.tolist(), token_len.tolist())):
        joined = torch.cat([prompt_token[row, :n_prompt], token[row, :n_token]])
        new_tokens.append(joined[cache.tokens_seen[row] :])
        cache.tokens_seen[row] = len(joined)
    encoded = IncrementalEncoder(flow).step(cache.encoder, new_tokens, finalize)

    # 2. decoder inputs for the new frames: row b's column i is frame start[b] + i
    start = encoded.mel_start
    committed = cache.decoder.committed if cache.decoder.started else [0] * sessions
    if start.tolist() != committed:
        raise RuntimeError(f"encoder resumes at frames {start.tolist()}, decoder at {committed}")
    mu, new_frames = encoded.mu, encoded.mel_len
    frames = mu.shape[2]
    if frames == 0:
        return mu.new_zeros(sessions, config.output_size, 0).float(), torch.zeros_like(new_frames)
    end = start + new_frames
    commit = torch.zeros_like(end) if finalize else end // chunk * chunk - start
    mask = (torch.arange(frames, device=device) < new_frames[:, None])[:, None].to(mu.dtype)
    cond = flow.prompt_condition(prompt_feat, prompt_feat_len.to(device), start, frames)
    if noise is None:
        noise = flow.decoder.noise
    noise = gather_frames(noise[:, :, : int(end.max())].expand(sessions, -1, -1), start, frames)
    spk = project_speaker(flow, embedding)
    mel = forward_chunk(flow.decoder, cache.decoder, mu, mask, spk, cond, noise, start.tolist(), commit.tolist())

    # 3. output: frames from the end of what was returned before
    emitted = torch.tensor(cache.emitted, device=device)
    out_len = (end - emitted).clamp(min=0)
    cache.emitted = torch.maximum(end, emitted).tolist()
    return flow.cut_rows(mel, emitted - start, out_len), out_len
