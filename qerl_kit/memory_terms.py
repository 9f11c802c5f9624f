"""The terms of ``qerl_kit.memory_plan``: bytes of every buffer a GRPO step allocates, from shapes.

Each function takes the model's shape (``memory_plan.model_shape``), its projections' (in, out)
sizes and the plan's checked settings, and returns ``{part name: bytes}``. A part's name starts
with the phase it lives in (``memory_plan.MemoryPlan`` sums by that prefix):

* no prefix of a phase (``weights:``, ``LoRA``, ``optimizer``, ``engine:``, ``kernels:``,
  ``fixed:``): allocated once and kept for the whole run;
* ``rollout:``: while the engine generates; with ``keep_cache`` the KV cache and the decode state
  stay allocated through the log-prob pass and the update too (the plan's ``kept`` names them);
* ``training:``: the log-prob pass and the update (they run one after the other; the update's
  working set contains the log-prob pass's: the same forward, plus gradients).

Every count is a bound of what the code allocates at once, each from the code path it names; where
the exact figure depends on what PyTorch frees in between, the term counts the tensors as if kept.
"""

from __future__ import annotations

CUBLAS_WORKSPACE_BYTES = 32 << 20  # PyTorch's cuBLAS workspace per (handle, stream): ":4096:8" on Hopper
STREAM_POOL = 32  # CUDA streams PyTorch's pool hands out per device (torch.cuda.Stream() takes them in turn)
PROMPT_BUCKET = 64  # StaticEngine's default prompt_bucket
MAX_PREFILL_TOKENS = 16384  # StaticEngine's default max_prefill_tokens
# Bytes per (row, vocabulary entry) of one decode step's logits and sampling (decoder.py's lm_head
# + .float(), sampler.process_logits + sample with temperature, top-k and top-p), every
# intermediate counted as if alive at once: lm_head out 2, float 4, / T 4, top-k mask 4, sort
# values 4 + indices 8, softmax 4, cumsum 4, remove + its scatter 2, masked_fill 4, log_softmax 4,
# rand_like 4, the Gumbel noise's two logs and negation 12, the perturbed scores 4.
SAMPLER_BYTES_PER_LOGIT = 64
# Bytes per element of one log-prob chunk in the update (logprobs.token_logprobs under checkpoint,
# recomputed in backward): the recompute's float copy, / T and log_softmax (4 each; the first two
# are freed once log_softmax returns, which saves its output), then in backward the gradients of
# the gather, the log_softmax and the division (4 each) and the chunk's gradient in the model's
# dtype (2) next to the saved output: at most 4 + 3 x 4 + 2.
CHUNK_BYTES_PER_ELEM = 18
# A chunk whose entropy is taken too: the no-grad log-prob pass's (loss.old_logp "pass"), or under
# "fold" the first update iteration's forward. log_softmax's float copy, / T and output (4 each), then
# the entropy's exp and product next to the output (logprobs._entropy, from _chunk_logp_entropy's
# log-softmax or, for a checkpointed chunk, its own, freed before the next chunk): at most 12, next
# to which the update's backward (CHUNK_BYTES_PER_ELEM) never runs at the same time.
ENTROPY_BYTES_PER_ELEM = 12


def projection_bytes(n_weights: int, fmt: str) -> int:
    """Bytes of ``n_weights`` projection weights stored in ``fmt`` (bf16 for the dense format)."""
    from qerl_kit.formats import DENSE, get_format

    return n_weights * 2 if fmt == DENSE else int(n_weights * get_format(fmt).bits_per_weight / 8)


def padded_prompt(a: dict) -> int:
    """The prompt width the engine stores: StaticEngine rounds the longest prompt up to ``prompt_bucket``."""
    p = a["prompt_len"]
    return -(-p // PROMPT_BUCKET) * PROMPT_BUCKET if a["engine"] == "static" and p else p


def _fused_groups(proj: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of the fused plan's concatenated groups (rollout/static/fast.py: q/k/v, gate/up)."""
    q, k, v, g, u = (proj[n] for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    return {"qkv": (q[0], q[1] + k[1] + v[1]), "gate_up": (g[0], g[1] + u[1])}


def uses_fused_plan(a: dict) -> bool:
    """Whether the StaticEngine's fused plan runs: it takes NVFP4Linear, NF4Linear, MXFP4Linear or
    nn.Linear projections (``fast._Group``); a registered format of another kind decodes on the generic path."""
    return a["engine"] == "static" and a["fused"] and a["fmt"] in ("nvfp4", "nf4", "mxfp4", "none")


def engine_parts(s: dict, proj: dict, a: dict) -> dict[str, int]:
    """The fused plan's own copy of q/k/v and gate/up (the weights again, concatenated, plus the q/k/v
    biases; none with ``share_weights``: the model's tensors are row blocks of it), and its dense copies
    of the small 4-bit groups it decodes with cuBLAS (``DENSE_DECODE``)."""
    if not uses_fused_plan(a):
        return {}
    groups = _fused_groups(proj)
    n = sum(i * o for i, o in groups.values())
    bias = groups["qkv"][1] * 2 if s["qkv_bias"] else 0
    parts = {} if a.get("share_weights") else \
        {f"engine: fused q/k/v + gate/up copy ({a['fmt']})": s["layers"] * (projection_bytes(n, a["fmt"]) + bias)}
    dense = _dense_decode_weights(groups, proj, a["fmt"])
    if dense:
        parts["engine: dense decode copies of small 4-bit groups (bf16)"] = s["layers"] * dense * 2
    return parts


def _dense_decode_weights(groups: dict, proj: dict, fmt: str) -> int:
    """Weights per layer of the 4-bit groups the fused plan holds a dense copy of (``fast._Group``'s
    ``dense_decode="auto"``: a group some decode row count sends to ``kernels.routes.DENSE_DECODE``)."""
    if fmt == "none":
        return 0
    from qerl_kit.kernels.routes import dense_decode_held

    every = {**groups, "o": proj["o_proj"], "down": proj["down_proj"]}
    return sum(i * o for i, o in every.values() if dense_decode_held(o, i, fmt))


def _humming_rows() -> list[tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int]]]:
    """(rows, n, k, weights) ranges of the routing table's forward rows that send a call to humming."""
    from qerl_kit.kernels.routes import ROUTES

    return [(r.rows, r.n, r.k, r.weights) for r in ROUTES if r.kernel == "humming" and r.op == "forward"]


def _humming_takes(n: int, k: int, rows: list[tuple[int, int]]) -> bool:
    """Whether some call with a row count in one of the closed ranges ``rows`` on an [n, k] weight routes to humming."""
    for (r0, r1), (n0, n1), (k0, k1), (w0, w1) in _humming_rows():
        if n0 <= n < n1 and k0 <= k < k1 and w0 <= n * k < w1 and any(lo < r1 and r0 <= hi for lo, hi in rows):
            return True
    return False


def _row_ranges(a: dict) -> dict[str, list[tuple[int, int]]]:
    """The row counts (closed ranges) the projections see: decode (``rollout_batch`` rows, fewer after
    live-row compaction), prefill (whole padded prompts per chunk) and the log-prob / update passes
    (micro-batches of prompt + completion; a completion may stop after one token)."""
    rows, group, micro = a["rollout_batch"], a["group_size"], a["micro_batch"]
    width, prompt = padded_prompt(a), a["prompt_len"]
    engine_rows = a.get("engine_rows", rows)  # plan_memory's max_rows: one engine batch
    if a["engine"] == "static":
        prompts = engine_rows // group
        chunk = min(prompts, max(1, MAX_PREFILL_TOKENS // max(width, 1)))
        prefill = [(chunk * width, chunk * width)] + ([((prompts % chunk) * width,) * 2] if prompts % chunk else [])
    else:  # transformers' generate prefills every row, the prompt repeated per sample
        prefill = [(rows * prompt, rows * prompt)]
    last = rows % micro or micro
    train = [(min(last, micro) * (prompt + 1), micro * (prompt + a["max_new_tokens"]))]
    return {"decode": [(1, engine_rows)], "prefill": prefill, "train": train}


def humming_parts(s: dict, proj: dict, a: dict) -> dict[str, int]:
    """humming-kernels' repacked copy of every NVFP4 weight the routing table may send to it
    (kernels/nvfp4_humming.py: the codes and scales in its own layout, the same bytes, kept while the
    weight lives): the fused plan's q/k/v and gate/up buffers and the o/down weights at decode rows;
    the model's own q/k/v/gate/up too where a prefill chunk or a micro-batch has few enough rows,
    or where the model's own modules decode (generic path, transformers' generate)."""
    if a["fmt"] != "nvfp4" or not a["humming"]:
        return {}
    ranges = _row_ranges(a)
    fused = uses_fused_plan(a)
    own_rows = ranges["prefill"] + ranges["train"] + ([] if fused else ranges["decode"])
    weights = [(i, o) for name, (i, o) in proj.items()
               if _humming_takes(o, i, own_rows + (ranges["decode"] if name in ("o_proj", "down_proj") else []))]
    if fused:
        weights += [(i, o) for i, o in _fused_groups(proj).values() if _humming_takes(o, i, ranges["decode"])]
    n = sum(i * o for i, o in weights)
    if not n:
        return {}
    return {"kernels: humming's repacked NVFP4 weights": s["layers"] * (n // 2 + n // 16)}


def kv_parts(s: dict, a: dict) -> dict[str, int]:
    """The KV cache as the engine allocates it (rollout/static/decoder.py ``KVCache.allocate``): with
    groups, each prompt's padded width once per group (the shared prefix) and every row's completion
    slots; transformers' cache holds every row at full length and grows by concatenation (one
    layer's keys and values twice while a step appends)."""
    rows, group, new = a["rollout_batch"], a["group_size"], a["max_new_tokens"]
    per_token = 2 * s["kv_heads"] * s["head_dim"] * a["kv_bytes"]
    width = padded_prompt(a)
    if a["engine"] == "static":
        tokens = rows // group * width + rows * new if group > 1 else rows * (width + new)
        return {f"rollout: KV cache ({rows} seqs x {width}+{new} tokens"
                + (f", prompt shared by groups of {group})" if group > 1 else ")"): s["layers"] * tokens * per_token}
    tokens = rows * (width + new)
    return {f"rollout: KV cache ({rows} seqs x {width}+{new} tokens)": (s["layers"] + 1) * tokens * per_token}


def decode_parts(s: dict, proj: dict, a: dict) -> dict[str, int]:
    """The engine's decode state (rollout/static/state.py: key bias, output tokens and log-probs,
    the compaction's and the completions' copies of those) and one step's working set: logits and
    sampling for every row, plus one layer's activations (freed blocks are reused within a step,
    inside a CUDA-graph capture as outside). The CUDA-graph pool is that working set: a state's
    graphs (its live-row views' included) share one pool, a capture allocates a step's tensors in
    it, and a replay allocates nothing."""
    rows, new, V = a["rollout_batch"], a["max_new_tokens"], s["vocab"]
    width = padded_prompt(a)
    out = {}
    if a["engine"] == "static":
        out["rollout: decode state (bias, outputs and their copies)"] = (rows * (width + new) * 2 + rows * new * 36
                                                                          + rows * 40)
    layer = rows * (4 * s["hidden"] + 2 * sum(o for _, o in proj.values()) + s["inter"]) * 4
    out[f"rollout: one decode step or its CUDA-graph capture (logits + sampling of {rows} rows, one layer)"] = \
        rows * V * SAMPLER_BYTES_PER_LOGIT + layer
    return out


def _layer_saved_per_token(s: dict, targets, a: dict) -> int:
    """Bytes per token that one decoder layer's forward keeps for backward (transformers' Qwen2/Llama
    layer with peft LoRA, dropout 0 as ``qerl_kit.lora`` attaches it): each RMSNorm its float32 input
    (``pow`` and the product save it) and its output (the projections' input); attention's rotated
    q and k, v, k and v expanded to every query head (``repeat_kv``), its output and the contiguous
    copy o_proj reads; the MLP's gate, up, activation and product; each LoRA's rank-r intermediate.
    Rotary's products save only cos/sin; the residual adds save nothing."""
    h, inter, ab = s["hidden"], s["inter"], a["act_bytes"]
    qw, kvw = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    norms = 2 * (4 * h + ab * h)
    attn = ab * (qw + 2 * kvw) + ab * 2 * qw + ab * 2 * qw
    return norms + attn + 4 * ab * inter + len(targets) * a["lora_r"] * a["lora_bytes"]


def _dequantized_bytes(proj: dict, a: dict) -> int:
    """The transient bf16 weight the dense path dequantizes for one matmul (kernels' ``dense`` route): the largest projection."""
    return 0 if a["fmt"] == "none" else 2 * max(i * o for i, o in proj.values())


def prefill_parts(s: dict, proj: dict, targets, a: dict) -> dict[str, int]:
    """One prefill chunk (no gradient, one layer at a time): a layer's tensors for every token of the
    chunk, the attention mask and, should SDPA take its math path, the scores; the first token's
    logits and sampling for the chunk's rows; one dequantized weight."""
    width, group = padded_prompt(a), a["group_size"]
    if a["engine"] == "static":
        prompts = min(a["rollout_batch"] // group, max(1, MAX_PREFILL_TOKENS // max(width, 1)))
        rows = prompts * group
    else:
        prompts = rows = a["rollout_batch"]
    tokens = prompts * width
    attention = prompts * width * width * (3 + s["heads"] * 4 * 2)
    logits = prompts * s["vocab"] * 6 + rows * s["vocab"] * SAMPLER_BYTES_PER_LOGIT
    layer = tokens * _layer_saved_per_token(s, targets, a)
    return {f"rollout: prefill of {prompts} prompts (one layer, mask, first-token sampling)":
            layer + attention + logits + _dequantized_bytes(proj, a)}


def training_parts(s: dict, proj: dict, targets, a: dict) -> dict[str, int]:
    """One micro-batch of the update (the log-prob pass is the same forward without gradients): the
    activations kept for backward (with checkpointing each layer's input, plus one layer recomputed),
    one layer's gradients in backward, the logits in the model's dtype (every position: what the padded
    layout makes; the aligned default's head computes the completion positions only, so this over-counts
    it by the prompt's positions) with the completion positions' gradient and one chunk's zero-padded
    gradient (autograd's slice backward allocates the full completion width), one float32 log-prob chunk
    forward and backward
    (``qerl_kit.logprobs.CHUNK_ELEMS``), one dequantized weight, and the dense weight cache."""
    from qerl_kit.logprobs import CHUNK_ELEMS

    L, h, V, ab, micro = s["layers"], s["hidden"], s["vocab"], a["act_bytes"], a["micro_batch"]
    new = a["max_new_tokens"]
    T = micro * (a["prompt_len"] + new)
    per_layer = T * _layer_saved_per_token(s, targets, a)
    acts = (L * T * h * ab + 2 * per_layer) if a["gradient_checkpointing"] else (L + 1) * per_layer
    positions = min(new, max(1, CHUNK_ELEMS // (micro * V)))
    chunk = micro * positions * V
    parts = {f"training: activations (micro-batch {micro}, "
             f"{'checkpointed' if a['gradient_checkpointing'] else 'all layers kept'}, + one layer's gradients)":
             acts + _dequantized_bytes(proj, a),
             "training: logits, their gradient and one chunk's": (T + 2 * micro * new) * V * ab,
             f"training: one float32 log-prob chunk ({positions} positions), forward + backward":
             chunk * max(CHUNK_BYTES_PER_ELEM, ENTROPY_BYTES_PER_ELEM)}
    if a["dense_cache_bytes"]:
        parts["training: dense weight cache (bf16)"] = a["dense_cache_bytes"]
    return parts


def dense_cache_all(s: dict, proj: dict, fmt: str | None = None, value_bytes: int = 2) -> int:
    """The bytes of every quantized projection in dense form (``value_bytes`` per weight, bf16 by
    default): what a dense weight cache holding them all takes. 0 for ``fmt="none"`` (a bf16 base
    has nothing to dequantize); ``fmt=None``: a shape without a format, every projection counted
    (``dense_update.dense_projection_bytes`` of a shape)."""
    return 0 if fmt == "none" else value_bytes * s["layers"] * sum(i * o for i, o in proj.values())


def fixed_parts(a: dict) -> dict[str, int]:
    """cuBLAS's workspace, one per stream that ran a matmul (PyTorch's CublasHandlePool keeps one per
    (handle, stream), from the caching allocator, for the process's life): the default stream, and
    with the StaticEngine's CUDA graphs the capture stream and the side stream of each capture's
    warm-up, a ``torch.cuda.Stream()`` from PyTorch's pool of 32 (a run captures one graph per
    attention length bucket, live-row view and batch shape, evaluation calls included: more than
    32 in any run of a few steps, so every pooled stream)."""
    streams = 1 + (1 + STREAM_POOL if a["engine"] == "static" else 0)
    return {f"fixed: cuBLAS workspaces ({streams} streams x 32 MiB)": streams * CUBLAS_WORKSPACE_BYTES}
