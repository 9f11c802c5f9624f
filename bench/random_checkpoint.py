"""A model directory any stack can load with ``from_pretrained``: a ``qerl_kit.models`` preset's shape with
random bf16 weights plus a byte-level tokenizer that covers every id (``write_random_checkpoint``), and
prompts of an exact token count for any tokenizer (``exact_prompts``). Used by ``bench.probe_unsloth`` and
``bench.bench_trl_step``: Unsloth, TRL and vLLM load models by path, so the random model must be a checkpoint.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import torch

BYTES = 256  # ids 0..255: the byte-level alphabet, so that any text encodes


def word(i: int) -> str:
    """Token ``BYTES + i`` of the random checkpoint's tokenizer is " " + word(i): a, b, ..., z, aa, ab, ...
    (letters only)."""
    s, i = "", i + 1
    while i:
        i, r = divmod(i - 1, 26)
        s = chr(97 + r) + s
    return s


def write_random_checkpoint(preset: str, path: str | Path, device: str = "cuda") -> dict:
    """Write a random bf16 checkpoint of ``preset``'s shape and its tokenizer to ``path``; returns
    {params_b, vocab, disk_gib, tokenizer_class}. Weights: norms 1, the rest N(0, 0.02) (sane activations),
    seed 0; built on ``device`` from meta (no CPU copy of a 7B). EOS and pad are the last two ids."""
    from transformers import AutoModelForCausalLM

    from qerl_kit.models import make_config  # published Qwen2.5 shapes (vocab 152064, rope 1e6, untied)

    config = make_config(preset)
    config.eos_token_id, config.pad_token_id = config.vocab_size - 2, config.vocab_size - 1  # as the tokenizer's
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    params_b = sum(p.numel() for p in model.parameters()) / 1e9
    model.save_pretrained(str(path))  # safetensors (rotary buffers are not saved: the loader recomputes them)
    del model
    tok_class = write_word_tokenizer(path, config.vocab_size, config.max_position_embeddings)
    disk = sum(f.stat().st_size for f in Path(path).iterdir()) / 2**30
    return dict(params_b=round(params_b, 3), vocab=config.vocab_size, disk_gib=round(disk, 2),
                tokenizer_class=tok_class)


def write_word_tokenizer(path: str | Path, n: int, max_len: int) -> str:
    """A byte-level BPE of ``n`` ids saved to ``path``: the 256 byte symbols, one letters-only word per
    remaining id ("Ġ" + word, built by merges), eos/pad last. transformers 5 loads ANY qwen2 directory's
    tokenizer as Qwen2Tokenizer, which rebuilds a byte-level BPE from tokenizer.json's vocab + merges (a
    word-level "t0".."tN" vocab then encodes text to []); so a real BPE, and len(tokenizer) == vocab size, so
    every id the model samples decodes. Returns the reloaded tokenizer's class name, after a round trip."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    words = ["\u0120" + word(i) for i in range(n - 2 - BYTES)]
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab |= {w: BYTES + i for i, w in enumerate(words)} | {"<|endoftext|>": n - 2, "<|pad|>": n - 1}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[(w[:-1], w[-1]) for w in words]))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", pad_token="<|pad|>",
                            model_max_length=max_len).save_pretrained(str(path))
    # the first, a middle and the last word (a fixed id past the last word failed the check for n <= 302)
    back, ids = AutoTokenizer.from_pretrained(str(path)), [BYTES, BYTES + (n - 3 - BYTES) // 2, n - 3]
    if len(back) != n or back("".join(" " + word(j - BYTES) for j in ids))["input_ids"] != ids:
        raise RuntimeError(f"the word tokenizer does not round-trip ({type(back).__name__}, {len(back)} tokens)")
    return type(back).__name__


_WORD = re.compile(r"^ ?[A-Za-z]+$")


def exact_prompts(tok, rows: int, length: int, seed: int = 0, candidates: int = 4000) -> list[str]:
    """``rows`` texts of random letter tokens that ``tok`` encodes (as TRL does: ``tok(text)``) to exactly
    ``length`` ids each. The pool: ids whose text is one word (" abc" or "abc") and encodes back to that one
    id; space-led words where there are enough (a BPE never merges across them), else bare letters (a
    byte tokenizer without merges). Every prompt is checked; a tokenizer that cannot make one is an error."""
    rng = random.Random(seed)
    vocab = len(tok)
    special = set(getattr(tok, "all_special_ids", []) or [])
    tries = rng.sample(range(vocab), min(vocab, candidates))
    pool = {}
    for i in tries:
        if i in special:
            continue
        text = tok.decode([i])
        if _WORD.match(text) and tok(text, add_special_tokens=False)["input_ids"] == [i]:
            pool[i] = text
    spaced = [t for t in pool.values() if t.startswith(" ")]
    words = spaced if len(spaced) >= 16 else [t for t in pool.values() if not t.startswith(" ")]
    if len(words) < 2:
        raise RuntimeError(f"no prompt pool in {type(tok).__name__}: {len(words)} single-token words found in "
                           f"{len(tries)} sampled ids")
    prefix = len(tok("", add_special_tokens=True)["input_ids"])  # a BOS the tokenizer adds, if any
    out = []
    for _ in range(rows):
        text = "".join(rng.choice(words) for _ in range(length - prefix))
        got = len(tok(text)["input_ids"])
        if got != length:
            raise RuntimeError(f"prompt of {length - prefix} pool words encodes to {got} tokens, wanted {length} "
                               f"({type(tok).__name__})")
        out.append(text)
    return out
