"""GPU family (tags 120-139): engine <-> gpu actor.

Contract: the gpu actor owns the weights and the KV cache tensors; it never decides what to run.
The engine sends one `StepPlan` per step and gets one `StepResult` back. Arrays are numpy.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from taipan.messages.codec import Array, message, struct
from taipan.messages.lifecycle import (
    IpcTensor,
    KVCacheManagementMode,
    WeightArray,
    WeightSpec,
    WeightTransferGroup,
)
from taipan.messages.requests import StructuredOutput, empty_array_field


class GpuCommand(enum.StrEnum):
    """What a GpuControl asks of the gpu actor (between steps). An update in two phases (an
    expert-parallel group commits only once every rank has staged): STAGE_WEIGHTS checks and
    holds the new weights as UPDATE_WEIGHTS would, changing nothing; COMMIT_WEIGHTS copies them
    in; DISCARD_WEIGHTS drops them."""

    SUSPEND = "suspend"
    RESUME = "resume"
    UPDATE_WEIGHTS = "update_weights"
    STAGE_WEIGHTS = "stage_weights"
    COMMIT_WEIGHTS = "commit_weights"
    DISCARD_WEIGHTS = "discard_weights"
    INIT_WEIGHT_TRANSFER = "init_weight_transfer"
    CLOSE_WEIGHT_TRANSFER = "close_weight_transfer"


@message(120, required=20)  # (speculative came later)
class LoadModel:
    """Load weights and size the KV cache: as many blocks as `kv_cache_gb` holds, at most
    `max_blocks` (more than every admissible request can use would only waste memory).
    `kv_cache_gb` None: the device's default (InferenceConfig.buffer_size_gb says which).
    `max_tokens`, `max_requests` and `max_sequence_length` bound every StepPlan: the worker
    sizes its persistent step buffers from them once, and captures its CUDA graphs at load."""

    model: str
    dtype: str
    device: str
    block_size: int
    max_blocks: int
    kv_cache_gb: float | None
    max_tokens: int
    max_requests: int
    max_sequence_length: int
    # Token counts to capture CUDA graphs for (actors/config.cuda_graph_sizes); () = none.
    cuda_graph_decode_sizes: tuple[int, ...] = ()
    cuda_graph_mixed_sizes: tuple[int, ...] = ()
    # Keep the KV cache at its address for good: suspend then only in persist mode.
    static_kv_memory_pointers: bool = False
    # Hybrid models only (an error for a model without Mamba layers). mamba_memory_ratio: the
    # share of the KV budget that holds live Mamba states instead (live slots = that share //
    # one slot's bytes, at most max_requests; None: max_requests live slots besides the KV).
    # mamba_snapshot_gb: prefix_caching_mamba_gb, the snapshot slots' budget besides the KV.
    mamba_memory_ratio: float | None = None
    mamba_snapshot_gb: float | None = None
    # InferenceConfig.mamba_inference_state_config as JSON ("": unset): state dtypes, and
    # shapes / layer pattern / chunk size the model must have.
    mamba_state_config: str = ""
    # Engine ranks that share this host's memory (data parallel on one machine): the CPU
    # default KV budget (kv_cache_gb None) is split between them.
    ranks_on_host: int = 1
    # Expert parallelism: this gpu actor's rank in its group of `expert_parallel_size` ranks
    # (1: none), which meet at `expert_parallel_init` (a torch.distributed init_method). Each
    # holds its share of the experts and exchanges tokens with the others in every MoE layer
    # (ops/expert_parallel.py); a StepPlan with no sequence is then a dummy step.
    expert_parallel_rank: int = 0
    expert_parallel_size: int = 1
    expert_parallel_init: str = ""
    # Tensor parallel on CUDA: the small all-reduces by the custom one-shot kernel
    # (InferenceConfig.custom_all_reduce: None where it can run, False never, True or fail).
    custom_all_reduce: bool | None = None
    # Speculative decoding (InferenceConfig.num_speculative_tokens > 0): mixed CUDA graphs also
    # keep every token's hidden state, so verify rows replay them instead of running eagerly.
    speculative: bool = False
    # Its k (0 with it off). A hybrid's live Mamba slots then come with k scratch slots each,
    # where a verify row's states after each of its first k tokens are kept, so the state of
    # the last accepted one replaces the slot's (actors/gpu/forward.py `_roll_back_states`).
    num_speculative_tokens: int = 0
    # speculative_method "draft_model": the draft's path ("": none). The worker loads it beside
    # the target (same tokenizer), with a KV cache of its own over the same block ids, and
    # fills a plan's draft tokens itself (StepPlan.draft_prev; actors/gpu/draft.py).
    draft_model: str = ""
    # Per-layer-group KV: a model whose windowed layers sit among layers that see their whole
    # context (Gemma 3's local layers) keeps the windowed layers' KV in a pool of its own,
    # rings of a request's last window (ModelLoaded.local_window); False: every layer in the
    # one pool. `local_kv_cache` (prefix caching on): that pool also caches the windowed keys
    # of cached prompt blocks, so it takes the windowed layers' whole share of the budget.
    local_kv_pool: bool = False
    local_kv_cache: bool = False
    # speculative_method "mtp": the checkpoint's multi-token-prediction head is loaded beside
    # the model (ops/models/qwen3_next.py; its KV in the model's cache) and drafts each
    # planned row's next num_speculative_tokens tokens at the end of every step (ops/mtp.py:
    # StepPlan.mtp_next / mtp_draft, StepResult.next_drafts).
    mtp: bool = False


@message(121, required=11)  # (tensor_parallel_size came later)
class ModelLoaded:
    """`tokenizer` is the JSON wire form of ops.tokenizer.Tokenizer (see ModelInfo)."""

    model: str
    num_blocks: int
    block_size: int
    vocab_size: int
    max_position_embeddings: int
    tokenizer: str
    eos_token_ids: tuple[int, ...]
    block_bytes: int  # one KV block over all layers (sizes paused_buffer_size_gb in blocks)
    # Hybrid (Mamba) models: the live Mamba state slots (one per request the rank may hold,
    # numbered 0..mamba_slots-1), the snapshot slots after them, and one slot's bytes over all
    # Mamba layers; 0: no Mamba. Under tensor parallelism the bytes (block_bytes too) are one
    # process's share; every process of the rank holds the same counts.
    mamba_slots: int = 0
    mamba_slot_bytes: int = 0
    mamba_snapshot_slots: int = 0
    # The rank's gpu processes (1 + its tensor-parallel followers): each joins a trainer's
    # weight-transfer group (messages/lifecycle.py InitWeightTransfer).
    tensor_parallel_size: int = 1
    # Mixture-of-experts layers (0: none; SamplingParams.return_routed_experts is refused).
    moe_layers: int = 0
    # Sliding-window attention: W > 0 when every attention layer attends to at most W keys (a
    # query at position p reads keys k with p - W < k <= p; W is the largest window over the
    # layers), so the engine gives back the KV blocks no later query reads; 0 when some layer
    # sees its whole context (no window, or global layers among windowed ones, as Gemma 3's).
    sliding_window: int = 0
    # A draft model with weights of its own is loaded (update_weights(draft=True) applies).
    draft_weights: bool = False
    # Per-layer-group KV (LoadModel.local_kv_pool): W > 0, the window of the windowed layers,
    # whose KV lives in a pool of `num_local_blocks` blocks of `local_block_bytes` (block_bytes
    # is then the other layers' block); 0: one pool for every layer.
    local_window: int = 0
    num_local_blocks: int = 0
    local_block_bytes: int = 0


@struct
class GrammarStart:
    """A request's grammar, sent to the gpu with the first step that samples for it."""

    request_id: int
    structured: StructuredOutput


@message(122, required=23)  # (logprobs_mode, routed experts and the controls came later)
class StepPlan:
    """One forward over B sequences and T tokens (varlen, no padding). Sequences with one query
    token (decode rows) come first, then those with more (prefill chunks). B = 0 (and T = 0):
    a dummy step, only under expert parallelism (the rank has no work in a step its group
    takes; the forward runs padding rows through every MoE exchange).

    input_ids int32[T], positions int32[T], slot_mapping int64[T];
    query_start_loc int32[B+1], seq_lens int32[B] (context after this step), block_tables
    int32[B, max_blocks]; sample int8[B] (1 = this sequence's last token is sampled);
    temperature float32[B], top_k int32[B], top_p float32[B], min_p float32[B], seeds int64[B],
    gen_index int32[B].

    Log-probs (log-softmax of the raw fp32 logits, before temperature / top-k / top-p, unless
    `logprobs_mode` says otherwise): logprobs int8[B] (1 = return the log-prob of the token
    sampled for this sequence); top_n int32[B] (how many top (id, log-prob) pairs to return for
    the sampled position, 0 = none); prompt_targets int32[T] (for each input token, the id of
    the token that follows it in the prompt, whose log-prob is wanted; -1 = not wanted; always
    raw). With any prompt target set, the worker materializes logits for those tokens too (in
    bounded chunks).
    """

    step: int
    input_ids: Array[np.int32, 1]
    positions: Array[np.int32, 1]
    slot_mapping: Array[np.int64, 1]
    query_start_loc: Array[np.int32, 1]
    seq_lens: Array[np.int32, 1]
    block_tables: Array[np.int32, 2]
    sample: Array[np.int8, 1]
    temperature: Array[np.float32, 1]
    top_k: Array[np.int32, 1]
    top_p: Array[np.float32, 1]
    min_p: Array[np.float32, 1]
    seeds: Array[np.int64, 1]
    gen_index: Array[np.int32, 1]
    logprobs: Array[np.int8, 1]
    top_n: Array[np.int32, 1]
    prompt_targets: Array[np.int32, 1]
    # For each input token, the row of the previous step whose sampled token is its id (its
    # input_ids entry is then ignored), -1 = take input_ids; empty = all -1. What lets a step be
    # planned before the previous one's tokens reach the host: the token goes from the device's
    # sampled-token buffer straight into this step's ids. A row the previous step did not
    # sample, or that it did not have, is an error.
    prev_rows: Array[np.int32, 1] = empty_array_field(np.int32)
    # Hybrid models (ModelLoaded.mamba_slots > 0), per sequence: the Mamba state slot its
    # initial state is read from (-1 = zeros: it starts at position 0) and the slot its final
    # state is written to; empty = the model has no Mamba layers. A sequence that continues
    # reads and writes its own slot.
    mamba_init: Array[np.int32, 1] = empty_array_field(np.int32)
    mamba_out: Array[np.int32, 1] = empty_array_field(np.int32)
    # Mamba snapshots (prefix caching): the state of sequence mamba_snap_row[i] after the first
    # mamba_snap_pos[i] tokens of its chunk (1..its query length) goes to snapshot slot
    # mamba_snap_dst[i] (every Mamba layer). At the chunk's end it is a copy of the out slot
    # after the forward; inside the chunk the conv and scan kernels store it.
    mamba_snap_row: Array[np.int32, 1] = empty_array_field(np.int32)
    mamba_snap_pos: Array[np.int32, 1] = empty_array_field(np.int32)
    mamba_snap_dst: Array[np.int32, 1] = empty_array_field(np.int32)
    # Per sequence, the distribution of its sampled position's log-prob and top-n
    # (messages/requests.py LogprobsMode): 0 = raw, 1 = processed (the one it was drawn from:
    # ops/sampling.py processed_logits); empty = all raw.
    logprobs_mode: Array[np.int8, 1] = empty_array_field(np.int8)
    # Some sequence wants its routed experts (SamplingParams.return_routed_experts): the
    # StepResult carries every input token's expert ids (`routed_experts`).
    return_routed_experts: bool = False
    # Sampling controls (SamplingParams: penalties, logit_bias, min_tokens, bad_words_ids; the
    # gpu applies them to a sampled row's logits, biases first, then the penalties, before
    # sampling and processed log-probs): every array empty when no sequence uses one.
    # Per sequence, float32[B] or empty (all off): presence and frequency (0 = off) and
    # repetition (1 = off) penalties.
    presence_penalty: Array[np.float32, 1] = empty_array_field(np.float32)
    frequency_penalty: Array[np.float32, 1] = empty_array_field(np.float32)
    repetition_penalty: Array[np.float32, 1] = empty_array_field(np.float32)
    # The penalised sequences' tokens, int32[K] each: sequence penalty_rows[i] has seen token
    # penalty_tokens[i], which adds penalty_counts[i] to the token's output count (0: a prompt
    # token, listed for repetition_penalty; entries of one token add up). They are the tokens
    # known when the step was planned: a row whose last input token is the previous step's
    # sampled one (prev_rows) counts that token too (the gpu adds it, as one output token).
    penalty_rows: Array[np.int32, 1] = empty_array_field(np.int32)
    penalty_tokens: Array[np.int32, 1] = empty_array_field(np.int32)
    penalty_counts: Array[np.int32, 1] = empty_array_field(np.int32)
    # Additive logit biases, [M] each: bias_values[i] (float32; -inf forbids: min_tokens, bad
    # words) is added to token bias_tokens[i] of sequence bias_rows[i] when bias_if_last[i] is
    # -1 or the sequence's last input token (a bad word whose next-to-last token the step in
    # flight samples: known only on the device).
    bias_rows: Array[np.int32, 1] = empty_array_field(np.int32)
    bias_tokens: Array[np.int32, 1] = empty_array_field(np.int32)
    bias_values: Array[np.float32, 1] = empty_array_field(np.float32)
    bias_if_last: Array[np.int32, 1] = empty_array_field(np.int32)
    # Structured outputs (SamplingParams.structured; ops/grammar.py): grammar_rows int64[B], the
    # request id of each sampled sequence with a grammar, else -1 (empty: no such sequence);
    # the gpu keeps one matcher per such request, advanced by the tokens it samples for it.
    # grammar_new: the grammars of requests it has no matcher for yet (request id, the
    # StructuredOutput); grammar_drop int64[]: requests whose matcher it may forget (ended).
    grammar_rows: Array[np.int64, 1] = empty_array_field(np.int64)
    grammar_new: list[GrammarStart] = dataclasses.field(default_factory=list)
    grammar_drop: Array[np.int64, 1] = empty_array_field(np.int64)
    # Speculative decoding (InferenceConfig.num_speculative_tokens; actors/gpu/speculative.py):
    # num_drafts int32[B], the draft tokens sequence i verifies (empty: none in this step). Its
    # last num_drafts[i] input tokens are the drafts, after its last known token; the gpu
    # scores all num_drafts[i] + 1 positions and returns what it accepts in
    # StepResult.spec_tokens. Such a sequence samples, reads no prev_rows, asks no prompt
    # log-probs (its new tokens' log-probs and top-n, raw or processed, come in
    # StepResult.spec_log_probs / spec_top_n_*), has no conditional (bad-word) bias and no
    # grammar; its penalties and biases apply at each scored position (bias_offsets below); it
    # replays a mixed CUDA graph where the config keeps their hidden states.
    num_drafts: Array[np.int32, 1] = empty_array_field(np.int32)
    # bias_offsets int32[M] (empty: every entry -1): for a bias entry of a verifying sequence,
    # the one scored position it applies at (0 = its last known token's, j = after its first j
    # drafts: min_tokens and bad words depend on the drafts before it); -1: every position.
    bias_offsets: Array[np.int32, 1] = empty_array_field(np.int32)
    # A draft model (LoadModel.draft_model): int32[B], the token before each verifying
    # sequence's last known one (-1 for the others; empty: no verify row). Its draft input
    # tokens are then placeholders the gpu fills: the draft model reads that token and the
    # last known one, then drafts greedily (actors/gpu/draft.py).
    draft_prev: Array[np.int32, 1] = empty_array_field(np.int32)
    # Allowed tokens (SamplingParams.allowed_token_ids), int32[A] each: sequence allow_rows[i]
    # may sample allow_tokens[i]; a sequence named here samples only its listed tokens (every
    # other's logit -inf, before the biases; at every scored position of a verifying one).
    allow_rows: Array[np.int32, 1] = empty_array_field(np.int32)
    allow_tokens: Array[np.int32, 1] = empty_array_field(np.int32)
    # Per-layer-group KV (ModelLoaded.local_window > 0; empty otherwise): the windowed layers'
    # block tables int32[B, max_blocks] (each sequence's ring repeated: column i holds its
    # positions [i * block_size, (i + 1) * block_size) while they are in its window) and the
    # slots of the step's tokens int64[T] in that pool.
    local_block_tables: Array[np.int32, 2] = empty_array_field(np.int32, 2)
    local_slot_mapping: Array[np.int64, 1] = empty_array_field(np.int64)
    # With prefix caching, int32[C] / [S] pairs of blocks of that pool (every windowed layer,
    # keys and values): before the forward block local_copy_src[i] is copied into
    # local_copy_dst[i] (a prefix hit's cached window into its ring), after it local_save_src[i]
    # into local_save_dst[i] (a computed prompt block into the cache). All copies of one kind
    # read before any writes.
    local_copy_src: Array[np.int32, 1] = empty_array_field(np.int32)
    local_copy_dst: Array[np.int32, 1] = empty_array_field(np.int32)
    local_save_src: Array[np.int32, 1] = empty_array_field(np.int32)
    local_save_dst: Array[np.int32, 1] = empty_array_field(np.int32)
    # An MTP head (LoadModel.mtp; empty otherwise), per sequence: mtp_next int32[B], for a
    # sequence that does not sample (a prompt chunk before its last), the token after its last
    # input token (the head at that position reads it), -1 for one that samples (it reads the
    # token drawn there); mtp_draft int8[B], 1 = return its drafts (StepResult.next_drafts).
    mtp_next: Array[np.int32, 1] = empty_array_field(np.int32)
    mtp_draft: Array[np.int8, 1] = empty_array_field(np.int8)
    # A chained verify step (InferenceConfig.speculative_chain_steps; actors/gpu/chain.py):
    # chain_steps > 1 lets the gpu run up to that many verify steps one after the other for
    # these sequences, drafting each next step itself by prompt lookup (ops/ngram.py with
    # chain_ngram int32[3] = min_n, max_n, k) over each sequence's known tokens
    # (chain_history int32[H], sequence i's at chain_history_loc[i]:chain_history_loc[i + 1],
    # ending with its last known token). Sequence i gains at most chain_limit[i] tokens, has
    # KV slots for positions below chain_capacity[i] (its block table's), and stops after
    # any token of chain_stops[chain_stops_loc[i]:chain_stops_loc[i + 1]]. Every sequence
    # verifies drafts, with no top-n or processed log-probs, controls, grammar or prev_rows
    # (the gpu refuses other plans); its new tokens come in StepResult.spec_tokens as one row
    # (their raw log-probs in spec_log_probs where asked) and the drafts and acceptances of
    # each inner step in StepResult.spec_chain. 0: one step.
    chain_steps: int = 0
    chain_ngram: Array[np.int32, 1] = empty_array_field(np.int32)
    chain_history: Array[np.int32, 1] = empty_array_field(np.int32)
    chain_history_loc: Array[np.int32, 1] = empty_array_field(np.int32)
    chain_limit: Array[np.int32, 1] = empty_array_field(np.int32)
    chain_capacity: Array[np.int32, 1] = empty_array_field(np.int32)
    chain_stops: Array[np.int32, 1] = empty_array_field(np.int32)
    chain_stops_loc: Array[np.int32, 1] = empty_array_field(np.int32)


@message(123, required=12)  # (routed_experts came later)
class StepResult:
    """token_ids int32[B] (-1 where not sampled); `error` set if the forward failed (or the
    worker is suspended).

    log_probs float32[B] (NaN where not asked or not sampled); top_n_ids int32[B, N] and
    top_n_log_probs float32[B, N] with N = max(plan.top_n) (rows past a sequence's own top_n,
    or not sampled: id -1, NaN); prompt_log_probs float32[K] for the K input tokens whose
    prompt_target >= 0, in token order, and prompt_top_n_ids int32[K, N] /
    prompt_top_n_log_probs float32[K, N] for them (N as above, from that sequence's top_n).
    Top-n pairs are sorted by descending log-prob. Without `error` these arrays always have
    these shapes (all NaN / -1, or K = 0, when nothing is asked); with `error` they may be empty.

    routed_experts int16 (int32 past 32767 experts) [T, moe_layers, top_k]: the global expert
    ids each MoE layer's router chose for each input token, when the plan asks
    (`return_routed_experts`); else empty. Under tensor parallelism every peer routes alike
    (the leader's are sent); under expert parallelism a rank's router runs on its own tokens
    before the exchange, so these are its tokens' choices. A chained verify step
    (StepPlan.chain_steps): each sequence's kept positions only (its last known token's and
    every accepted draft's, inner step after inner step), the sequences back to back.
    """

    step: int
    token_ids: Array[np.int32, 1]
    error: str | None
    forward_seconds: float
    # Device time of the step's work (CUDA events around it; on CPU its compute wall time), and
    # whether it ran from a captured CUDA graph.
    device_seconds: float = 0.0
    graphed: bool = False
    log_probs: Array[np.float32, 1] = empty_array_field(np.float32)
    top_n_ids: Array[np.int32, 2] = empty_array_field(np.int32, 2)
    top_n_log_probs: Array[np.float32, 2] = empty_array_field(np.float32, 2)
    prompt_log_probs: Array[np.float32, 1] = empty_array_field(np.float32)
    prompt_top_n_ids: Array[np.int32, 2] = empty_array_field(np.int32, 2)
    prompt_top_n_log_probs: Array[np.float32, 2] = empty_array_field(np.float32, 2)
    routed_experts: Array[(np.int16, np.int32), 3] = empty_array_field(np.int16, 3)
    # Speculative decoding: int32[B, K+1] with K = max(plan.num_drafts), when the plan has
    # drafts (else empty): sequence i's new tokens, its accepted drafts then the token drawn at
    # the first rejection (or the bonus token), -1 after; rows without drafts all -1 (their
    # token is token_ids[i], which for a row with drafts is its first new token).
    # A chained verify step (StepPlan.chain_steps): [B, W], every new token of the chain's
    # inner steps in order, -1 after.
    spec_tokens: Array[np.int32, 2] = empty_array_field(np.int32, 2)
    # A chained verify step: int32[B, chain_steps, 2], (drafts verified, of which accepted) of
    # sequence i in inner step j; -1 where it ran no such step. Empty otherwise.
    spec_chain: Array[np.int32, 3] = empty_array_field(np.int32, 3)
    # float32[B, K+1]: the raw log-prob of each of spec_tokens, for the sequences with drafts
    # that ask for log-probs (NaN elsewhere; empty when none asks). Such a sequence's
    # log_probs[i] is of its last scored position, not of a token it gains: read these.
    spec_log_probs: Array[np.float32, 2] = empty_array_field(np.float32, 2)
    # int32 / float32 [B, K+1, N], N = the verifying rows' largest top_n: the raw top-n of each
    # of spec_tokens, for the sequences with drafts that ask (-1 / NaN elsewhere; empty when
    # none asks).
    spec_top_n_ids: Array[np.int32, 3] = empty_array_field(np.int32, 3)
    spec_top_n_log_probs: Array[np.float32, 3] = empty_array_field(np.float32, 3)
    # An MTP head (StepPlan.mtp_draft): int32[B, k], the drafts for sequence i's next verify
    # row, to follow the last token this step gave it (-1 after its last draft, and for the
    # sequences that asked none); empty when none asked.
    next_drafts: Array[np.int32, 2] = empty_array_field(np.int32, 2)
    # Structured outputs (actors/gpu/grammar_masks.py, "check" mode, where the next step does
    # not wait for the grammar check and reads the old token): the rows whose sampled token
    # the check replaced. Such a request's row in the step in flight, if it has one, is void:
    # its token is dropped and its position computed again (the engine plans it with the
    # replaced token).
    grammar_fixed: Array[np.int32, 1] = empty_array_field(np.int32)


@message(124, required=4)  # (the weight-transfer fields came later)
class GpuControl:
    """Engine -> gpu actor, only between steps: "suspend" (with `mode` "persist", "offload" or
    "recompute"; None is an error: the engine resolves the config default), "resume",
    "update_weights" / "stage_weights" (with exactly one of `path`, `state`, `buckets` or `ipc`,
    as messages.lifecycle.UpdateWeights, UpdateWeightsFromDistributed and UpdateWeightsFromIpc;
    the engine sends them only while PAUSED or SUSPENDED; `weight_version` None: the last + 1),
    "init_weight_transfer" (with `transfer`) and "close_weight_transfer". Fields a command does
    not use are ignored.

    `buckets` arrive over the weight-transfer group (ops/weight_transfer.py). Without staging
    each bucket is copied in as it arrives: a transfer that fails part way leaves the weights
    mixed, and the reply says so (`weights_incomplete`) until a complete update lands.
    `ipc` tensors are opened and mapped when staged (an update stages, then commits), so an
    update from IPC copies nothing until every tensor opened and fitted (on every TP peer).

    update_weights checks everything before it changes anything: a checkpoint at `path` must
    have the loaded architecture (same hyper-parameters and shapes); each `state` name must be
    a parameter of the loaded model in Hugging Face naming (the "model." prefix optional;
    q/k/v_proj and gate/up_proj land in their rows of our fused projections; with tied
    embeddings "lm_head.weight" is the embedding matrix, and may come alongside an equal
    "model.embed_tokens.weight") with its exact shape and a float dtype (float16/32/64: bfloat16
    cannot travel as a numpy array). Weights are copied in place, in the model's dtype.
    A step while suspended gets a StepResult with `error` "the gpu worker is suspended"."""

    command: GpuCommand
    mode: KVCacheManagementMode | None
    path: str | None
    state: dict[str, WeightArray] | None
    weight_version: int | None = None
    transfer: WeightTransferGroup | None = None
    buckets: list[list[WeightSpec]] | None = None
    ipc: list[IpcTensor] | None = None
    # update_weights / stage_weights with `path` or `state`: the draft model's weights
    # (UpdateWeights.draft); a commit commits what was staged, draft or target.
    draft: bool = False


@message(125, required=4)  # (weights_incomplete came later)
class GpuControlReply:
    """`error` None on success; otherwise the text says why and nothing changed (a suspend or
    resume in the wrong state names the state). `kv_valid`: False when the KV contents are
    dropped: the reply to a "suspend" in mode "recompute", and to the "resume" that follows it
    (every cached token must be recomputed); True otherwise. Update_weights leaves the KV as it
    was (computed with the old weights). `weight_version`: the weights' version (0 = as
    loaded; each update sets it). `weights_incomplete`: a transfer failed after it had copied
    some of its weights in; steps and unpause are refused until a complete update lands."""

    command: GpuCommand
    error: str | None
    kv_valid: bool
    weight_version: int
    weights_incomplete: bool = False
    # The weights it updated or committed are the draft model's (GpuControl.draft): the
    # target's, and their version, are as they were.
    draft: bool = False


@message(126)
class NoStep:
    """Never sent: the engine records it in its log, on its gpu channel, when it planned and
    found nothing to run (no chunk, no block to free). Such a plan can still change the
    scheduler (an abort ends, a request pauses), so `taipan replay --check` must replay it at
    the same point; `step` is the number of the last step planned before it."""

    step: int


# ---- tensor-parallel peers of one rank (actors/gpu/peers.py) ----------------------------------
# The leader gpu actor publishes every LoadModel, StepPlan and GpuControl it gets to its
# followers unchanged; the followers answer over one DEALER with these (never a step's result),
# and the leader says goodbye over the same connection.


@message(130)
class PeerHello:
    """A follower's first message: its SUB socket is connected and it takes the leader's
    messages from now on. `tp_rank` 1..T-1; `pid` for the logs."""

    tp_rank: int
    pid: int


@message(131)
class PeerOutcome:
    """How a follower's LoadModel ("load") or GpuControl (its command) ended: `error` None when
    it succeeded, else why. `index` counts the loads and controls the follower took (1, 2, ...),
    as the leader counts those it published, so an answer cannot be taken for another's."""

    tp_rank: int
    index: int
    command: str
    error: str | None


@message(132)
class PeerBye:
    """The leader to each follower, when its rank stops cleanly: take nothing more, exit 0. (A
    follower whose connection to the leader closes without it exits non-zero.)"""

    reason: str
