"""``[engine.cosyvoice2]`` and ``[engine.cosyvoice2.vllm]``: the CosyVoice2 engine's settings.

Torch-free, so that the gateway reads and checks them on any machine. Validation runs in
``__post_init__``; the config loader turns a ``ValueError`` here into a message that names
the offending key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tts_gateway.engine.cosyvoice2.modeldir.layout import default_voices_dir

# CUDA_MPS_CLIENT_PRIORITY's values, by the name the settings use.
MPS_PRIORITIES = {"normal": "0", "below-normal": "1"}


@dataclass(frozen=True)
class VLLMSettings:
    """``[engine.cosyvoice2.vllm]``: the LLM stage on vLLM (``llm_backend = "vllm"``).

    The defaults suit an 80-141 GB card; docs/cosyvoice2.md gives values for a 24-32 GB one.
    """

    # Share of the card's memory vLLM may take (weights + KV cache + graphs). The rest is
    # the token2wav stage's: keep this + token2wav_memory_gb within the card.
    gpu_memory_utilization: float = 0.35
    # Memory the token2wav stage needs (flow + HiFT at max_batch); checked against the
    # card at start-up so that the two stages cannot starve each other.
    token2wav_memory_gb: float = 16.0
    max_num_seqs: int = 256  # concurrent utterances decoded in one batch
    max_num_batched_tokens: int = 8192  # tokens per engine step (prefill chunks + decodes)
    max_model_len: int = 4096  # prompt + speech tokens of one utterance
    enforce_eager: bool = False  # True: no CUDA graphs (faster start, slower steps)
    enable_prefix_caching: bool = True  # voice prompts are a shared prefix
    dtype: str = "bfloat16"  # the LM's weights on vLLM: bfloat16, float16, float32
    # vLLM's pipelined scheduling (next step scheduled before the last one is processed):
    # faster steps, but on vLLM 0.26 a bistream round then returned a token past its stop, so
    # the engine refuses it (bench/llm_burst.py measures it on one-input requests).
    async_scheduling: bool = False
    # Under CUDA MPS, the client priority of vLLM's engine core (CUDA_MPS_CLIENT_PRIORITY):
    # "below-normal" lets token2wav's kernels go first when both stages have work. The LLM
    # runs far ahead of playback, token2wav's calls are what listeners wait for.
    mps_priority: str = "normal"
    # Under CUDA MPS, the share of the GPU's threads vLLM's engine core may use, in percent
    # (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; 100: not set, as the operator's environment has it).
    # A cap, not a reservation.
    mps_thread_percentage: int = 100
    # Under CUDA MPS, the client priority of the gateway's own process, whose GPU work is
    # token2wav's: "below-normal" lets the LLM's decode steps go first when both stages have
    # work. The engine sets it in its process's environment before its first CUDA context, and
    # then gives vLLM's engine core its own mps_priority explicitly. Normal: on an H100 at 64
    # sessions it was worse (86% of replies stall-free against 97%), the LLM slower even before
    # token2wav had work, which is not understood (docs/benchmarks.md, fifteenth round).
    token2wav_mps_priority: str = "normal"
    # Batch sizes run once before /readyz says ready: vLLM compiles a sampler kernel per
    # new batch shape, which otherwise stalls first audio by seconds during serving.
    warmup_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)

    def __post_init__(self) -> None:
        if not 0.05 <= self.gpu_memory_utilization <= 0.95:
            raise ValueError("gpu_memory_utilization must be between 0.05 and 0.95")
        if self.token2wav_memory_gb < 0:
            raise ValueError("token2wav_memory_gb must be >= 0")
        if not 1 <= self.max_num_seqs <= 4096:
            raise ValueError("max_num_seqs must be between 1 and 4096")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if self.max_model_len < 256:
            raise ValueError("max_model_len must be >= 256")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError("dtype must be float32, bfloat16 or float16")
        for name in ("mps_priority", "token2wav_mps_priority"):
            if getattr(self, name) not in MPS_PRIORITIES:
                raise ValueError(f"{name} must be one of {', '.join(MPS_PRIORITIES)}")
        if not 1 <= self.mps_thread_percentage <= 100:
            raise ValueError("mps_thread_percentage must be between 1 and 100")
        if any(not 1 <= n <= self.max_num_seqs for n in self.warmup_batch_sizes):
            raise ValueError("warmup_batch_sizes must lie between 1 and max_num_seqs")

    def engine_core_environment(self) -> dict[str, str]:
        """What vLLM's engine core process gets in its environment beyond the gateway's: the
        MPS client settings above that differ from MPS's defaults (CUDA reads them when that
        process starts; without MPS they do nothing)."""
        environment = {}
        # With token2wav's priority set, this process's environment holds it: the engine core
        # would inherit it, so its own is set even where it is MPS's default.
        if self.mps_priority != "normal" or self.token2wav_mps_priority != "normal":
            environment["CUDA_MPS_CLIENT_PRIORITY"] = MPS_PRIORITIES[self.mps_priority]
        if self.mps_thread_percentage != 100:
            environment["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(self.mps_thread_percentage)
        return environment

    def token2wav_environment(self) -> dict[str, str]:
        """What the gateway's own process (token2wav's CUDA client) gets in its environment
        before its first CUDA context: ``token2wav_mps_priority`` where it is not MPS's default."""
        if self.token2wav_mps_priority == "normal":
            return {}
        return {"CUDA_MPS_CLIENT_PRIORITY": MPS_PRIORITIES[self.token2wav_mps_priority]}


@dataclass(frozen=True)
class CosyVoice2Settings:
    # An official CosyVoice2-0.5B directory (what it holds: engine/cosyvoice2/modeldir/layout.py).
    model_dir: str = ""
    # Registered zero-shot voices. Empty: <model_dir>/voices.
    voices_dir: str = ""
    # Voice name or id used when a client names none. Empty: the first registered voice.
    default_voice: str = ""
    device: str = "auto"  # auto (cuda if present), cpu, cuda, cuda:N
    dtype: str = "float32"  # flow and LLM weights: float32, bfloat16, float16 (HiFT stays float32)
    # torch: plain PyTorch, one thread per utterance (CPU, tests, small deployments).
    # vllm: continuous batching across utterances on a GPU ([engine.cosyvoice2.vllm]).
    llm_backend: str = "torch"
    # Streaming token2wav (official defaults): chunks of token_hop_len speech tokens
    # (25 = 1 s of audio), growing by stream_scale_factor per chunk up to token_max_hop_len.
    token_hop_len: int = 25
    token_max_hop_len: int = 100
    # The first chunk is the shortest hop of at least this many tokens that ends prompt +
    # chunk on a 25-token boundary (the flow's attention chunk), so its frames are final.
    # 25 is the official first chunk (25 + the padding to the boundary); a smaller value
    # speaks the first audio sooner, as soon as the boundary allows (a GPU deployment's
    # lever for time to first audio).
    token_first_hop_len: int = 25
    # With a short first chunk (token_first_hop_len below token_hop_len): keep it only when the
    # chunk after it can follow before it has played, judged per stream from its tokens' pace
    # and the recent flow call time, and only while the load has not risen since those calls
    # (scheduler.LOAD_RISE_FACTOR); else start with the official first chunk. Trades first
    # audio for no stall under load (H200: docs/benchmarks.md). Off: always the short one.
    first_chunk_by_load: bool = False
    # ... judging that the chunk after it, while the token2wav engine thread runs a round of
    # calls, waits for a whole recent round (a bound on what is left of it), not one call: with
    # the first-chunk lane (and urgent_chunks_between_calls off) no chunk goes between a
    # round's calls. On an H100 at 64 sessions 23 of 26 stalls were the chunk after a kept short
    # first chunk (docs/benchmarks.md, thirteenth round). More first chunks are lengthened:
    # fewer stalls, later first audio. Not yet measured: off.
    first_chunk_waits_round: bool = False
    # The token2wav engine thread launches its next call before it waits for the one in flight,
    # so that the GPU has the next call's work queued while the host finishes the last one.
    # Off: on an H100 at 64 sessions it did not stand out of the spread of repeated runs, and
    # the opening burst's first audio came later (docs/benchmarks.md, eleventh round).
    launch_ahead: bool = False
    # GPU: the token2wav engine thread's calls wait until this many chunks are ready, while
    # every listener of those chunks has audio to spare (1: every call runs as soon as one chunk
    # is ready). A call costs much the same for a few rows as for several (its kernels are
    # latency-bound at small sizes), so fewer, larger calls serve more sessions: on an H100 at
    # 64 sessions (fused kernels on) 98% of replies were stall-free with 8, 89% with 1
    # (docs/benchmarks.md). A CPU, whose calls cost their rows, runs each call at once. Held to
    # max_batch.
    min_call_rows: int = 8
    # A token2wav call of new turns' first chunks also takes later chunks no wider than they
    # are (more rows, no more padding): in a burst of new turns, the second chunks of the turns
    # served first then need not wait behind the rest of the burst's first-chunk calls. False
    # keeps first and later chunks in calls apart.
    later_chunks_with_first: bool = True
    # The token2wav engine thread serves a playing listener whose audio would run out within
    # about two recent calls before new turns' first chunks (the first-chunk lane still takes
    # those): a reply that has begun does not stall for another's first audio. False: a
    # listener with no audio always goes first.
    playing_listeners_first: bool = True
    # A batch of the token2wav engine thread may run as several calls (a round); a playing
    # listener's chunk that becomes ready during one goes between its calls when it would be
    # late after the rest of the round (in a burst of new turns an H100's calls took up to half
    # a second, docs/benchmarks.md), and urgent chunks get calls of their own, run first (with
    # playing_listeners_first). Off: on two H100s at 64 sessions it did not stand out of the
    # spread of repeated runs, and new turns' first audio came later (docs/benchmarks.md); so
    # such chunks wait for the round's end, and share calls with chunks of their width.
    urgent_chunks_between_calls: bool = False
    stream_scale_factor: int = 1
    # A reply that reaches this many speech tokens per text token without eos is ended
    # there (the official maximum ratio, 20). Benchmarks on random weights, which never
    # sample eos, set a real speaking rate (~7) so that replies last as long as real ones.
    max_speech_per_text_token: float = 20.0
    # How the flow streams (all exact: each chunk equals the official flow's streaming call).
    # paged: turns keep their decoder state in a pool of token2wav_cache_gb, batched across
    # sessions, so a chunk costs its own frames (serving/turn_pool.py; needs prefix_voices).
    # incremental: each utterance keeps its own state, unbatched (~4.9 MB per mel frame at
    # full size in float32). recompute: the official way, re-run the flow over everything so
    # far for every chunk (no state). auto: incremental on CPU; paged on GPU (recompute without
    # prefix_voices): at 64 sessions on an H100 94-98% of replies were stall-free paged, 18-79%
    # by recompute (docs/benchmarks.md).
    # A listener about to run out of audio gets the tokens there are (at least
    # token_first_hop_len) as an early chunk instead of waiting for a whole hop, while the
    # token2wav worker has time for it. Keeps text streamed at LLM speed from stalling
    # between the short first chunk and the second; off = the official chunking only.
    early_chunks: bool = True
    # GPU: a second token2wav worker thread runs new turns' first chunks on a CUDA stream of
    # the highest priority, with CUDA graphs of its own, so that first audio does not wait
    # for the flow call in flight (engine/cosyvoice2/serving/scheduler.py). Without it, at 64
    # sessions on an H100, TTFA p95 rose by 0.1-0.25 s (docs/benchmarks.md, 2026-12-07 ninth).
    first_chunk_lane: bool = True
    # ... and its calls of several rows start the decoder after their voices' prefixes when the
    # bank holds them (~100 instead of ~250 decoder frames a row with a 3.6 s prompt), reading
    # the bank while the main thread serves (their slots pinned meanwhile). Exact. Off: on an
    # H100 it served 4-5 of 52-56 lane calls at 64 sessions and 15 of 93 at 128 (the burst's
    # first chunks reach the lane a row or two at a time), too few to tell (docs/benchmarks.md).
    first_chunk_lane_after_prefix: bool = False
    # ... and with a short first chunk, the chunk after it too (its listener holds a fraction
    # of a second). Fewer and shorter stalls after the first chunk, but under load first
    # chunks then wait behind those calls on the lane (H200: docs/benchmarks.md).
    second_chunk_on_lane: bool = False
    flow_mode: str = "auto"
    # Paged mode's pool of turns' decoder state (each attention layer's input, per Euler step
    # and CFG row): ~0.57 MB per mel frame at full size in bf16 (8 GB: ~4.6 min of speech
    # being generated at once). A turn that finds it full goes on by recompute after its voice
    # prefix instead (counted), so this bounds memory, not sessions.
    token2wav_cache_gb: float = 8.0
    # The last chunk of a turn: "chunk" is the official flow's streaming mode (chunk-causal,
    # like every other chunk; it costs its own frames), "full" the official tts() loop's
    # full-attention pass over the whole turn (O(turn), once per turn).
    final_chunk_attention: str = "chunk"
    # Euler steps of the flow's solver in every flow mode (the voice prefixes, the paged pool and
    # the incremental state are kept per step, so their memory scales with it too). 10 is the
    # official count. Fewer trade quality for speed by an amount this project cannot measure
    # without real weights: opt-in (docs/cosyvoice2.md).
    flow_steps: int = 10
    max_batch: int = 16  # token2wav chunks run together
    # GPU: CUDA graphs of the flow solve, captured before the gateway reports ready (a
    # batch-1 chunk drops from ~280 ms eager to ~50 ms). Batches up to graph_max_batch
    # (padded to 1, 2, 4, ...), contexts up to graph_max_frames (prompt + speech so far,
    # 50 frames per second, padded to a multiple of graph_frame_step, coarser beyond 12
    # of them), batch x frames within a call's work limit (the call planner keeps calls
    # there); other calls run eagerly. 0 turns graphs off.
    graph_max_batch: int = 16
    graph_max_frames: int = 3200
    graph_frame_step: int = 50
    # Recompute mode: a streaming batch (on a GPU, of more than one row) starts the decoder
    # after the voice prompt's whole chunks, whose state is the same in every call and is kept in a
    # bank of this many slots for the most recently used voices (~2.3 MB per prompt frame
    # and slot at full size in bf16: ~0.32 GB for a 3.6 s prompt; a quarter more in paged
    # mode, whose pool copies the prefixes' layer inputs from it). Exact; 0 = off.
    prefix_voices: int = 4
    # GPU: CUDA graphs of the HiFT vocoder for the streamed chunk shapes at every batch
    # bucket up to max_batch (engine/cosyvoice2/serving/hift_graphs.py); final chunks run eagerly.
    hift_graphs: bool = True
    # ... and one-row graphs of every other chunk length (last chunks, early chunks: 52-76
    # lengths a voice with 25-token hops, 224-247 with 200), replayed row by row, instead of eager calls
    # of ~500 small kernels each (serving/hift_graphs.py). With the next setting, on an H100 at 64
    # sessions: the engine thread's vocoder 22-25 instead of 29-50 ms of GPU time a call, its
    # thread time 5-6 instead of 59-78 ms (235 graphs, 21 s of start-up, 0.17 GiB).
    hift_graphs_all_lengths: bool = True
    # GPU, paged flow: the engine thread's token encoder (a paged call's incremental encode,
    # ~600 ops launched one by one: 26-45 ms of a ~200 ms call on an H100 at 64 sessions) by
    # CUDA graphs of its encoder pass, with the turns' caches copied into their inputs
    # (engine/cosyvoice2/serving/incremental_encoder_graphs.py; exact). On an H100 at 64
    # sessions: 10-11 instead of 19-25 ms of GPU time a call (236 graphs, 7 s, 4.45 GiB).
    paged_encoder_graphs: bool = True
    # The flow decoder's attention (an additive chunk mask, which SDPA's flash kernel does not
    # take) runs on cuDNN's kernel or else the memory-efficient one. Importing vLLM turns
    # cuDNN's SDPA off for the whole process (vllm/platforms/cuda.py, for other models' sake);
    # vLLM's own model runs in its engine core process, so true turns it back on in the
    # gateway's: on the H200 later-chunk calls took 20-37% less time (docs/cosyvoice2.md).
    flow_cudnn_attention: bool = True
    # GPU: the flow decoder's layer norms as fused Triton kernels (model/fused_norms.py): each
    # causal block's norm, Mish, mask and following add in one kernel, and each transformer
    # block's residual add with the norm after it in another, instead of 4-6 small kernels and
    # copies each. In a paged call each causal convolution's input too (its left context from
    # the turn-state pool or the voice prefix, the new context back to the pool) in one kernel
    # instead of 9 (serving/fused_context.py). On an H100 a paged call's decoder took 31% less
    # time a call and 13% less a row-frame (docs/benchmarks.md). Exact on CPU through Triton's
    # interpreter, and on an H100 the turns' mels lie as far from the plain ops' as a mere change
    # of summation order puts them (bfloat16 rounding). False runs the plain torch ops (CPUs always do).
    flow_fused_kernels: bool = True
    # The watchdog: a token2wav call running this long, or an utterance whose text has all
    # been sent waiting this long for its next speech token, means a stage has hung; the engine
    # then fails every utterance and reports itself failed (the gateway ends its sessions and
    # exits for a restart). Well above any healthy call or token gap, which take well under a second.
    stall_timeout_s: float = 30.0
    vllm: VLLMSettings = field(default_factory=VLLMSettings)

    def __post_init__(self) -> None:
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError("device must be auto, cpu, cuda or cuda:N")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError("dtype must be float32, bfloat16 or float16")
        if self.llm_backend not in ("torch", "vllm"):
            raise ValueError("llm_backend must be 'torch' or 'vllm'")
        if not 1 <= self.token_hop_len <= self.token_max_hop_len:
            raise ValueError("need 1 <= token_hop_len <= token_max_hop_len")
        if not 1 <= self.token_first_hop_len <= self.token_max_hop_len:
            raise ValueError("need 1 <= token_first_hop_len <= token_max_hop_len")
        if self.stream_scale_factor < 1:
            raise ValueError("stream_scale_factor must be >= 1")
        if self.flow_mode not in ("auto", "paged", "incremental", "recompute"):
            raise ValueError("flow_mode must be auto, paged, incremental or recompute")
        if self.token2wav_cache_gb < 0:
            raise ValueError("token2wav_cache_gb must be >= 0")
        if self.final_chunk_attention not in ("chunk", "full"):
            raise ValueError("final_chunk_attention must be 'chunk' or 'full'")
        if isinstance(self.flow_steps, bool) or not isinstance(self.flow_steps, int) or self.flow_steps < 1:
            raise ValueError(f"flow_steps must be an integer >= 1 (10 is the official count), got {self.flow_steps!r}")
        if self.max_speech_per_text_token <= 0:
            raise ValueError("max_speech_per_text_token must be > 0")
        if self.prefix_voices < 0:
            raise ValueError("prefix_voices must be >= 0")
        if not 0 <= self.graph_max_batch <= self.max_batch:
            raise ValueError("need 0 <= graph_max_batch <= max_batch")
        if not 1 <= self.graph_frame_step <= self.graph_max_frames:
            raise ValueError("need 1 <= graph_frame_step <= graph_max_frames")
        if not self.stall_timeout_s > 0:
            raise ValueError("stall_timeout_s must be > 0")
        if not 1 <= self.max_batch <= 1024:
            raise ValueError("max_batch must be between 1 and 1024")
        if self.min_call_rows < 1:
            raise ValueError("min_call_rows must be >= 1")

    @property
    def voices_path(self) -> Path:
        """Where registered voices live: ``voices_dir``, else beside the model."""
        return Path(self.voices_dir) if self.voices_dir else default_voices_dir(self.model_dir)
