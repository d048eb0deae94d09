"""The CosyVoice2 engine's own Prometheus series: their names and help texts.

The engine reports them in ``EngineStats.extra`` (gauges) and ``.totals``; the gateway
exports them with the ``tts_`` prefix and documents them from here (the engine's descriptor).
"""

from __future__ import annotations

# The kinds of token2wav call (engine/cosyvoice2/serving/chunking.py, call_kind). In paged mode
# last chunks share the later chunks' calls, which then count as calls of later chunks.
CALL_KINDS = {"first": "first chunks", "later": "later chunks", "final": "final chunks"}
# The stages of an utterance's first audio, each between two moments of its first chunk: its
# text given to the LLM stage, its first speech token, its tokens all there, its token2wav call
# launched, done (serving/latency.py books them as first_audio_<stage>_seconds).
FIRST_AUDIO_STAGES = {
    "llm_first_token": ("text", "first_token"), "llm_chunk": ("first_token", "ready"),
    "token2wav_wait": ("ready", "launched"), "token2wav_run": ("launched", "done"),
}
# The phases of a token2wav call (engine/cosyvoice2/serving/phase_clock.py, the runner's laps)
# and what each holds.
PHASES = {
    "flow_other": "the flow's work around its calls (batch arguments, voice prefixes, the vocoder's inputs)",
    "encoder": "the token encoder (of paged calls, calls after voice prefixes and whole flow calls)",
    "decoder": "the paged call's decoder, with the pool's reads and writes",
    "unpaged": "flow calls outside the pool (recompute, incremental, last chunks of full attention) "
    "but their token encoder (an incremental call's stays here)",
    "vocoder": "the vocoder",
    "output": "cross-fades and the audio's copy to the host",
    "wait": "the wait for the call's audio on the host (the thread's time only)",
}
# The token2wav threads whose calls are timed phase by phase, by their totals' infix.
PHASE_THREADS = {"": "engine thread", "lane_": "first-chunk lane"}
# Exported as tts_<name> (EngineStats.extra) and tts_<name>_total (EngineStats.totals).
GAUGES = {
    "llm_streams": "Utterances the LLM stage is decoding.",
    "llm_running_requests": "LLM requests in the running batch (the decode batch size).",
    "llm_waiting_requests": "LLM requests waiting to be scheduled.",
    "llm_kv_cache_usage_ratio": "Share of the LLM's KV cache in use (0..1).",
}
TOTALS = {
    "llm_generated_tokens": "Speech tokens the LLM stage sampled.",
    "llm_prompt_tokens": "Prompt tokens the LLM stage took in (voice prompts and text).",
    "llm_prefix_cache_queried_tokens": "Prompt tokens looked up in the LLM's prefix cache.",
    "llm_prefix_cache_hit_tokens": "Prompt tokens found in the LLM's prefix cache (hit rate = hit / queried).",
    "llm_steps": "LLM engine steps.",
    "llm_inter_token_seconds": "Time between a request's consecutive speech tokens, summed (mean = / llm_inter_tokens).",
    "llm_inter_tokens": "Speech tokens that followed another of their request (the count behind llm_inter_token_seconds).",
    "token2wav_batches": "Batches the token2wav worker ran (chunks / batches = mean batch size).",
    "token2wav_chunks": "Audio chunks the token2wav worker made.",
    "token2wav_busy_seconds": "Time the token2wav worker spent running batches (a rate near 1 = saturated).",
    "token2wav_first_lane_batches": "Batches the token2wav first-chunk lane ran (turns' opening chunks; GPU).",
    "token2wav_first_lane_chunks": "Chunks the token2wav first-chunk lane made (first chunks; with "
    "second_chunk_on_lane, the chunk after a short first chunk too).",
    "token2wav_first_lane_busy_seconds": "Time the token2wav first-chunk lane spent running batches.",
    "token2wav_early_chunks": "Chunks spoken early, with the tokens there were, for a listener about to run dry.",
    "token2wav_first_chunks_lengthened": "Streams started with the official first chunk, not the short one, "
    "because the chunk after it could not have followed in time (first_chunk_by_load).",
    "token2wav_flow_calls": "Flow (decoder) calls of the token2wav stage, both threads.",
    **{f"token2wav_calls_{kind}": f"token2wav calls (flow and vocoder) of {what}, both threads."
       for kind, what in CALL_KINDS.items()},
    **{f"token2wav_call_seconds_{kind}": f"Time of token2wav calls of {what} (mean = / token2wav_calls_{kind})."
       for kind, what in CALL_KINDS.items()},
    **{f"token2wav_call_gpu_seconds_{kind}": f"GPU time of token2wav calls of {what} (their stream's timeline, idle gaps "
       f"included; mean = / token2wav_calls_{kind}; GPU only)." for kind, what in CALL_KINDS.items()},
    "token2wav_flow_eager_calls": "Flow calls with no CUDA graph for their shape (run eagerly).",
    "token2wav_flow_encoder_graph_calls": "Flow calls whose token encoder ran as a CUDA graph's replay (the "
    "first-chunk lane's, and paged calls' with paged_encoder_graphs).",
    "token2wav_flow_lane_calls_after_prefix": "Flow calls of the first-chunk lane that started after their voices' "
    "prefixes (first_chunk_lane_after_prefix).",
    "token2wav_flow_vocoder_eager_calls": "Vocoder calls no CUDA graph held (run eagerly), both threads.",
    "token2wav_flow_row_frames_first": "Mel frames the flow computed in calls of first chunks (rows x each row's "
    "width).",
    "token2wav_flow_row_frames_later": "Mel frames the flow computed in calls of later chunks (rows x widths; in "
    "paged mode with the last chunks that share them).",
    "token2wav_flow_row_frames_final": "Mel frames the flow computed in calls of final chunks (rows x widths).",
    "token2wav_flow_padded_row_frames": "Mel frames the flow computed with padding (rows and frames padded to the "
    "call's widest row or graph bucket); 1 - needed / padded is the share spent on padding.",
    **{f"token2wav_flow_{thread}phase_calls": f"Calls of the token2wav {who} timed phase by phase (the "
       f"token2wav_flow_{thread}phase_* totals; mean = / this)." for thread, who in PHASE_THREADS.items()},
    **{f"token2wav_flow_{thread}phase_gpu_seconds_{phase}": f"GPU time of {what}, in calls of the token2wav {who} "
       "(its stream's timeline, idle gaps included)." for thread, who in PHASE_THREADS.items()
       for phase, what in PHASES.items()},
    **{f"token2wav_flow_{thread}phase_thread_seconds_{phase}": f"The token2wav {who}'s time in {what} (launching, "
       "or waiting for the GPU)." for thread, who in PHASE_THREADS.items() for phase, what in PHASES.items()},
    "token2wav_turn_state_peak_bytes": "Most GPU memory the paged pool of turns' decoder state held at once, "
    "since start (flow_mode paged).",
    "token2wav_turn_state_stored_bytes": "Decoder state stored for turns (stored / turns = memory per turn).",
    "token2wav_turn_state_turns": "Turns that stored decoder state in the pool.",
    "token2wav_turn_state_fallbacks": "Turns that found too few free pages in the pool and went on by recompute "
    "after their voice prefix instead (a turn each time it fell back).",
    "token2wav_turn_state_returns": "Turns that fell back and came back to the pool once it had room for them.",
    "first_audio_chunks": "Utterances' first chunks delivered (divide the first_audio_*_seconds totals by it).",
    "first_audio_llm_first_token_seconds": "First chunks: first text given to the LLM stage to its first speech token.",
    "first_audio_llm_chunk_seconds": "First chunks: first speech token to the chunk's tokens all there.",
    "first_audio_token2wav_wait_seconds": "First chunks: tokens all there to their token2wav batch starting.",
    "first_audio_token2wav_run_seconds": "First chunks: their token2wav batch running.",
    "late_chunks_llm_bound": "Chunks out after their listener ran out of audio, whose tokens came too late.",
    "late_chunks_token2wav_bound": "Chunks out after their listener ran out of audio, whose tokens were there in time.",
}
