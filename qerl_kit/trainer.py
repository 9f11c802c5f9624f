"""The GRPO/DAPO loop on a 4-bit base: rollouts under AQN, rewards, advantages, clipped updates.

``Trainer(model, tokenizer, dataset, reward_fns, config)`` owns all training state (optimizer,
scheduler, step, AQN, metrics), so ``train(steps)`` can be called again and again from a
notebook, with a slider changed in between (``trainer.set_lr(...)``, ``trainer.aqn.sigma_start``).
One step:

1. sample ``batch_size / group_size`` prompts (seeded by (seed, step), so a resumed run draws
   the same prompts), and generate ``group_size`` completions each with the policy under AQN
   noise (``with aqn.noise(...)``); the noise is removed before any training forward;
2. score them with TRL-style reward functions, add DAPO overlong shaping if asked, optionally
   drop groups whose rewards are all equal and refill (dynamic sampling);
3. group-normalized advantages; the clean policy's log-probs (``old``), the reference's
   (adapter disabled) when ``beta > 0``, entropy, and truncated importance weights between the
   rollout log-probs (noisy, sampled) and the clean training log-probs;
4. ``mu`` optimizer steps on the batch in micro-batches, with gradient clipping and the lr
   schedule (a step whose gradient norm is inf/NaN is skipped and counted in ``update/skipped``,
   as verl does, instead of writing NaN into the adapter); then metrics (TRL's names where one
   exists) and, every ``save_every`` steps, a checkpoint from which ``resume()`` continues exactly.

Launched by ``torchrun`` (or ``accelerate launch``) the same Trainer runs data-parallel: each
rank takes a slice of whole groups, advantages and loss normalizers are global, the adapter's
gradients are all-reduced by DDP, metrics are reduced, and rank 0 alone logs and checkpoints
(``qerl_kit.distributed``, docs/distributed.md).
"""

from __future__ import annotations

import json
import math
import time
import warnings
from pathlib import Path
from typing import Callable, Sequence

import torch

from qerl_kit import checkpoint as ckpt
from qerl_kit import distributed
from qerl_kit import grpo, runs
from qerl_kit.aqn import AQN
from qerl_kit.config import TrainConfig
from qerl_kit.logprobs import batched_logprobs, completion_logprobs
from qerl_kit.engine import make_engine
from qerl_kit.rollout import Rollouts, SamplingParams
from qerl_kit.sampling_filters import filter_groups, overlong_penalty


def _default_prompt_fn(tokenizer, row) -> str:
    from qerl_kit.data import build_prompt

    return build_prompt(tokenizer, row["prompt"])


def _make_optimizer(params, cfg):
    if cfg.optimizer == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as err:
            raise ImportError("optim.optimizer='adamw8bit' needs bitsandbytes: pip install "
                              "'qerl_kit[gpu]' (or pick optimizer='adamw')") from err
        return bnb.optim.AdamW8bit(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def _lr_lambda(cfg, total_steps: int) -> Callable[[int], float]:
    warmup = int(cfg.warmup_ratio * total_steps)

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(total_steps - warmup, 1)
        if cfg.schedule == "linear":
            return max(0.0, 1 - frac)
        if cfg.schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        return 1.0
    return fn


class Trainer:
    """GRPO/DAPO on a (quantized) LoRA model; see the module docstring for one step."""

    def __init__(self, model, tokenizer, dataset: Sequence[dict], reward_fns: Sequence[Callable],
                 config: TrainConfig, *, engine=None, eval_dataset: Sequence[dict] | None = None,
                 prompt_fn: Callable | None = None, accuracy_fn: Callable | None = None,
                 progress: str = "auto"):
        if not dataset:
            raise ValueError("Trainer needs a non-empty dataset")
        if not reward_fns:
            raise ValueError("Trainer needs at least one reward function")
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("the model has no trainable parameters; attach LoRA first "
                             "(qerl_kit.lora.attach_lora)")
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.dataset, self.eval_dataset = list(dataset), eval_dataset
        self.reward_fns = list(reward_fns)
        self.accuracy_fn = accuracy_fn or self.reward_fns[0]
        self.prompt_fn = prompt_fn or _default_prompt_fn
        self.engine = engine or make_engine(config.rollout.engine, model, tokenizer)
        self.progress = progress
        self.dist = distributed.Context.detect()  # world 1 unless launched by torchrun & co
        distributed.check_config(config, self.dist.world)
        self.aqn = AQN(config.aqn.sigma_start, config.aqn.sigma_end, config.aqn.stages,
                       config.total_steps, seed=config.seed, resample=config.aqn.resample,
                       allow_increasing=config.aqn.allow_increasing) \
            if config.aqn.enabled else None
        self.optimizer = _make_optimizer(trainable, config.optim)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(config.optim, config.total_steps))
        self.step = 0
        self.history: list[dict] = []
        self.output_dir = Path(config.output_dir)
        self.run_id = runs.new_run_id()  # a resumed run takes its checkpoint's
        self._claimed = False            # output_dir made this run's (qerl_kit.runs.claim) before any write
        self.stop_requested = False  # a widget's stop button sets this; the current step finishes
        self._tb = None
        if config.log_tensorboard and self.dist.main:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ImportError("log_tensorboard=True needs the tensorboard package: pip install tensorboard") from err
            self._tb = SummaryWriter(str(self.output_dir / "tensorboard"))
        if config.model.gradient_checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if hasattr(model, "enable_input_require_grads"):
                model.enable_input_require_grads()
        self._ddp = distributed.wrap_ddp(model, self.dist)  # None on one process

    # ---- controls a notebook can call between chunks ----------------------------------------
    def set_lr(self, lr: float) -> None:
        """Change the base learning rate (the schedule keeps multiplying it)."""
        for group in self.optimizer.param_groups:
            group["initial_lr"] = lr
        self.scheduler.base_lrs = [lr for _ in self.scheduler.base_lrs]
        for group, fn in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            group["lr"] = lr * fn(self.scheduler.last_epoch)

    @property
    def metrics(self):
        """Metrics so far as a pandas DataFrame (one row per step)."""
        import pandas as pd

        return pd.DataFrame(self.history)

    # ---- one step --------------------------------------------------------------------------
    def _rows(self, step: int, round_: int = 0) -> list[dict]:
        g = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step * 101 + round_)
        idx = torch.randint(len(self.dataset), (self.config.rollout.prompts_per_step,), generator=g)
        return [self.dataset[i] for i in idx.tolist()]

    def _sampling(self, step: int, round_: int, first_group: int = 0) -> SamplingParams:
        r = self.config.rollout  # the seed also depends on the call's first global group (0 on one process)
        return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              seed=self.config.seed * 7919 + step * 31 + round_ + first_group * distributed.SEED_STRIDE)

    @staticmethod
    def _checked_scores(fn, scores, n: int) -> list:
        """A reward function's scores, one per completion, or an error that names the function."""
        name = getattr(fn, "__name__", type(fn).__name__)
        if scores is None:
            raise TypeError(f"reward function {name!r} returned None; it must return one score (a float, or None "
                            f"for 'not applicable') per completion: a list of {n}")
        if isinstance(scores, torch.Tensor):
            scores = scores.tolist()
        try:
            scores = list(scores)
        except TypeError:
            raise TypeError(f"reward function {name!r} returned {type(scores).__name__}, not a list of "
                            f"{n} scores") from None
        if len(scores) != n:
            raise ValueError(f"reward function {name!r} returned {len(scores)} scores for {n} completions; "
                             "it must return exactly one per completion")
        for s in scores:
            if s is not None and not isinstance(s, (int, float)):
                raise TypeError(f"reward function {name!r} returned a score of type {type(s).__name__} ({s!r}); "
                                "scores are floats, or None for 'not applicable'")
        return scores

    def _score(self, rows: list[dict], rollouts: Rollouts) -> tuple[torch.Tensor, dict, torch.Tensor]:
        G = self.config.rollout.group_size
        columns = {k: [row[k] for row in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
        ids = [c[m.bool()].tolist() for c, m in zip(rollouts.completion_ids, rollouts.completion_mask)]
        per_fn, metrics = [], {}
        for fn in self.reward_fns:
            scores = self._checked_scores(
                fn, fn(prompts=rollouts.prompts, completions=rollouts.texts, completion_ids=ids, **columns),
                len(rollouts.texts))
            per_fn.append(scores)
            vals = torch.tensor([float("nan") if s is None else float(s) for s in scores])
            name = getattr(fn, "__name__", type(fn).__name__)
            metrics[f"rewards/{name}/mean"] = vals.nanmean().item()
            metrics[f"rewards/{name}/std"] = vals[~vals.isnan()].std().item() if (~vals.isnan()).sum() > 1 else 0.0
        rewards = grpo.combine_rewards(per_fn)
        acc_scores = per_fn[self.reward_fns.index(self.accuracy_fn)] if self.accuracy_fn in self.reward_fns else \
            self._checked_scores(self.accuracy_fn, self.accuracy_fn(prompts=rollouts.prompts, completions=rollouts.texts,
                                                                    completion_ids=ids, **columns), len(rollouts.texts))
        correct = torch.tensor([1.0 if (s is not None and s >= 1.0) else 0.0 for s in acc_scores])
        lc = self.config.loss
        if lc.overlong_buffer > 0:
            rewards = rewards + overlong_penalty(rollouts.completion_mask.sum(1).cpu(), self.config.rollout.max_new_tokens,
                                                 lc.overlong_buffer, lc.overlong_penalty)
        return rewards, metrics, correct

    def _collect(self, step: int):
        """Rollouts, rewards and per-step metrics, with DAPO dynamic sampling when enabled."""
        cfg, G = self.config, self.config.rollout.group_size
        kept: list[tuple[Rollouts, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        n_kept, rounds, t_rollout, metrics, stats = 0, 0, 0.0, {}, {}
        target = cfg.rollout.prompts_per_step // self.dist.world
        while True:
            rows = self._rows(step, rounds)
            part = distributed.group_slice(len(rows), self.dist.rank, self.dist.world)  # whole groups
            rows = rows[part]
            prompts = [self.prompt_fn(self.tokenizer, row) for row in rows]
            t0 = time.perf_counter()
            if self.aqn is not None:
                with self.aqn.noise(self.model, step) as count:
                    rollouts = self.engine.generate(prompts, G, self._sampling(step, rounds, part.start))
                metrics["aqn/sigma"], metrics["aqn/stage"], metrics["aqn/norms"] = \
                    self.aqn.sigma(step), self.aqn.stage(step), count
            else:
                rollouts = self.engine.generate(prompts, G, self._sampling(step, rounds, part.start))
            t_rollout += time.perf_counter() - t0
            stats = getattr(rollouts, "stats", {}) or {}
            rewards, reward_metrics, correct = self._score(rows, rollouts)
            if rounds == 0:
                metrics.update(reward_metrics)
                metrics["reward"], metrics["accuracy"] = rewards.nanmean().item(), correct.mean().item()
                metrics["frac_reward_zero_std"] = grpo.frac_reward_zero_std(rewards, G)
            rounds += 1
            keep = filter_groups(rewards, G) if cfg.loss.dynamic_sampling else torch.ones(len(rows), dtype=torch.bool)
            last = not cfg.loss.dynamic_sampling or rounds >= cfg.loss.max_sampling_rounds
            if last and n_kept + int(keep.sum()) < target:
                keep = torch.ones(len(rows), dtype=torch.bool)  # out of rounds: fill with what we have
            idx = [g * G + j for g in keep.nonzero().flatten().tolist()[: target - n_kept] for j in range(G)]
            if idx:
                kept.append((rollouts, torch.tensor(idx), rewards, correct))
                n_kept += len(idx) // G
            if n_kept >= target:
                break
        metrics["time/rollout"] = t_rollout
        metrics["rollout/tokens_per_s"] = stats.get("rollout/tokens_per_s", float("nan"))
        if cfg.loss.dynamic_sampling:
            metrics["sampling/rounds"] = rounds
        batch = Rollouts.concat([r.select(i) for r, i, _, _ in kept]) if len(kept) > 1 or \
            len(kept[0][1]) != len(kept[0][0].texts) else kept[0][0]
        rewards = torch.cat([rw[i] for _, i, rw, _ in kept])
        return batch, rewards, metrics

    def train_step(self) -> dict:
        cfg, lc, step = self.config, self.config.loss, self.step
        G, temp = cfg.rollout.group_size, cfg.rollout.temperature
        start = time.perf_counter()
        batch, rewards, metrics = self._collect(step)
        mask = batch.completion_mask.float()
        if lc.mask_truncated:
            keep = torch.tensor([r != "length" for r in batch.finish_reasons], dtype=mask.dtype, device=mask.device)
            mask = mask * keep[:, None]
        all_rewards = self.dist.all_gather(rewards)  # the global batch's (= rewards on one process)
        mine = slice(self.dist.rank * len(rewards), (self.dist.rank + 1) * len(rewards))
        adv = grpo.group_advantages(all_rewards, G, scale=lc.scale_rewards)[mine].to(mask.device)  # rewards: CPU
        t0 = time.perf_counter()
        self.model.eval()
        old_logp, entropy = batched_logprobs(self.model, batch, temp, lc.micro_batch, with_entropy=True)
        ref_logp = None
        if lc.beta > 0:
            with self.model.disable_adapter():
                ref_logp = batched_logprobs(self.model, batch, temp, lc.micro_batch)
        is_w = None
        if lc.is_correction:
            is_w, is_stats = grpo.importance_weights(old_logp, batch.logprobs, mask, mode=lc.is_correction, cap=lc.is_cap)
            metrics.update(is_stats)
        metrics["time/logprob"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.model.train()
        loss_fn, n, W = grpo.LOSSES[lc.loss], mask.shape[0], self.dist.world
        eps_high = lc.eps_low if lc.eps_high is None else lc.eps_high  # the one value loss and stats use
        kwargs = dict(eps_low=lc.eps_low, eps_high=eps_high, beta=lc.beta)
        # normalizers of the global batch: all ranks' tokens (DAPO), W*n sequences, the widest completion (Dr. GRPO)
        total_tokens = self.dist.sum(mask.sum()).clamp(min=1)
        extra = {"dapo": {"num_tokens": total_tokens}, "grpo": {},
                 "dr_grpo": {"max_len": int(self.dist.max(torch.tensor(mask.shape[1])))}}[lc.loss]
        forward = self._ddp if self._ddp is not None else self.model
        starts = list(range(0, n, lc.micro_batch))
        skipped = 0
        for _ in range(lc.mu):
            loss_sum = 0.0
            for s in starts:
                sl = slice(s, s + lc.micro_batch)
                with distributed.no_sync(self._ddp, s != starts[-1]):  # all-reduce once, after the last
                    logp = completion_logprobs(forward, batch.prompt_ids[sl], batch.prompt_mask[sl],
                                               batch.completion_ids[sl], batch.completion_mask[sl], temp)
                    loss = loss_fn(logp, old_logp[sl], adv[sl], mask[sl],
                                   ref_logp=None if ref_logp is None else ref_logp[sl],
                                   is_weights=None if is_w is None else is_w[sl], **kwargs, **extra)
                    if lc.loss != "dapo":  # sequence-mean losses: weight each chunk by its share
                        loss = loss * (logp.shape[0] / (n * W))
                    (loss * W if W > 1 else loss).backward()  # DDP averages over ranks; W x mean = sum
                loss_sum += loss.item()
            params = [p for p in self.model.parameters() if p.requires_grad]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.max_grad_norm)
            if torch.isfinite(grad_norm):  # the same on every rank: DDP all-reduced the gradients
                self.optimizer.step()
            else:  # one inf/NaN gradient would turn the adapter and Adam's moments into NaN for good
                skipped += 1
                warnings.warn(f"step {step + 1}: gradient norm is {float(grad_norm)}; optimizer step skipped "
                              "(the adapter is unchanged; see update/skipped)", RuntimeWarning, stacklevel=2)
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.model.eval()
        metrics["time/update"] = time.perf_counter() - t0
        with torch.no_grad():
            new_logp = batched_logprobs(self.model, batch, temp, lc.micro_batch) if lc.mu > 1 else old_logp
        metrics.update(grpo.clip_stats(new_logp, old_logp, adv, mask, lc.eps_low, eps_high))
        lengths = batch.completion_mask.sum(1).float()
        ent = self.dist.sum(torch.stack([(entropy * mask).sum(), mask.sum()]).double())
        metrics.update({
            "step": step + 1, "loss": loss_sum, "grad_norm": float(grad_norm), "lr": self.scheduler.get_last_lr()[0],
            "update/skipped": skipped,
            "reward_std": all_rewards.std().item() if all_rewards.numel() > 1 else 0.0,
            "entropy": (ent[0] / ent[1].clamp(min=1)).item() if W > 1 else ((entropy * mask).sum() / mask.sum().clamp(min=1)).item(),
            "completions/mean_length": lengths.mean().item(),
            "completions/clipped_ratio": sum(r == "length" for r in batch.finish_reasons) / len(batch.finish_reasons),
            "num_tokens": int(batch.completion_mask.sum()),
        })
        if ref_logp is not None:
            metrics["kl"] = grpo.kl_k3(old_logp, ref_logp, mask).item()
        metrics["time/step"] = time.perf_counter() - start
        self.step += 1
        return distributed.reduce_metrics(metrics, self.dist)  # the same row on every rank

    # ---- the loop ----------------------------------------------------------------------------
    def train(self, steps: int | None = None, callback: Callable[[dict], None] | None = None) -> "Trainer":
        """Run ``steps`` more steps (default: up to ``config.total_steps``); callable repeatedly."""
        steps = self.config.total_steps - self.step if steps is None else steps
        if not self._claimed:
            self.claim_output_dir()
        bar = self._bar(steps)
        for _ in range(steps):
            if self.dist.any(self.stop_requested):  # a stop pressed on any rank stops them all
                break
            row = self.train_step()
            if self.config.eval_every and self.step % self.config.eval_every == 0 and self.eval_dataset \
                    and self.dist.main:  # rank 0 evaluates; the others wait at the next step's first collective
                row["eval/accuracy"] = self.evaluate().accuracy
            self.history.append(row)
            if self.dist.main:
                self._log(row)
            if self.config.save_every and self.step % self.config.save_every == 0:
                self.save()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{row['reward']:.3f}", acc=f"{row['accuracy']:.2f}",
                                entropy=f"{row['entropy']:.3f}")
            if callback is not None:
                callback(row)
        if bar is not None:
            bar.close()
        self.stop_requested = False  # a stop ends this chunk only (cleared at the end, so a stop
        return self                  # pressed just before the chunk starts is not lost)

    def _bar(self, steps: int):
        if self.progress == "none" or steps <= 0 or not self.dist.main:
            return None
        if self.progress == "text":
            from tqdm import tqdm
        else:
            from tqdm.auto import tqdm
        return tqdm(total=steps, desc=f"GRPO step {self.step}", unit="step")

    def _log(self, row: dict) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        with open(self.output_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(key, value, row["step"])
            self._tb.flush()

    def evaluate(self, dataset: Sequence[dict] | None = None, **kwargs):
        """Held-out accuracy with the adapter applied (greedy unless ``temperature`` is given)."""
        from qerl_kit.evaluate import evaluate

        data = dataset if dataset is not None else self.eval_dataset
        if not data:
            raise ValueError("no evaluation dataset: pass one here or as Trainer(eval_dataset=...)")
        kwargs.setdefault("temperature", 0.0)
        kwargs.setdefault("max_new_tokens", self.config.rollout.max_new_tokens)
        return evaluate(self.model, self.tokenizer, data, self.accuracy_fn, engine=self.engine,
                        prompt_fn=self.prompt_fn, **kwargs)

    # ---- the run directory and checkpoints ----------------------------------------------------
    def claim_output_dir(self, command: str = "train") -> Path | None:
        """Make ``output_dir`` this run's before anything is written to it (``qerl_kit.runs.claim``):
        another run found there moves to ``output_dir/previous-runs/`` (said on stdout; nothing is
        deleted), and the path it moved to is returned. Called by ``train``, ``save`` and
        ``resume``; a notebook or script may call it first to choose the command name."""
        moved = None
        if self.dist.main:
            moved = runs.claim(self.output_dir, self.run_id, command)
            if moved is not None:
                print(f"{self.output_dir} held another run; it was moved to {moved} (nothing deleted)")
        self.dist.barrier()
        self._claimed = True
        return moved

    def save(self) -> Path:
        """Write ``checkpoint-<step>`` (rank 0 writes, every rank waits for it); returns its path.

        Nothing in it depends on the world size (the adapter and optimizer state are replicated), so
        a run saved on W ranks resumes on any number of ranks."""
        if not self._claimed:
            self.claim_output_dir()
        path = self.output_dir / f"checkpoint-{self.step}"
        if self.dist.main:
            state = {"step": self.step, "optimizer": self.optimizer.state_dict(),
                     "scheduler": self.scheduler.state_dict(), "rng": ckpt.rng_state(),
                     "aqn": self.aqn.state_dict() if self.aqn else None, "world_size": self.dist.world,
                     "history": json.dumps(self.history), "config": json.dumps(self.config.to_dict()),
                     "run_id": self.run_id}
            path = ckpt.save_checkpoint(self.output_dir, self.step, self.model, state, self.config.keep_checkpoints,
                                        run_id=self.run_id)
        self.dist.barrier()
        return path

    def resume(self, checkpoint: str | Path | None = None, allow_config_change: bool = False) -> int:
        """Continue from ``checkpoint`` (default: the newest under output_dir); returns its step.

        The checkpoint must hold exactly this model's adapter tensors (``CheckpointError`` names the
        checkpoint and the tensor otherwise), and the config it was saved with must equal this one
        up to the keys that do not change training (``checkpoint.RESUME_NEUTRAL``): a change is refused unless
        ``allow_config_change``, and then applied to the optimizer, the lr schedule and AQN alike and
        logged to ``output_dir/config_changes.jsonl``."""
        path = Path(checkpoint) if checkpoint else ckpt.latest_checkpoint(self.output_dir)
        path = self.dist.broadcast(path)  # rank 0's choice, so all ranks load the same one
        if path is None:
            return self.step
        state = ckpt.load_state(path)
        current = json.loads(json.dumps(self.config.to_dict()))  # as saved: tuples become lists
        defaults = json.loads(json.dumps(TrainConfig().to_dict()))  # for keys newer than the checkpoint
        changes = ckpt.config_changes(json.loads(state["config"]), current, defaults) if "config" in state else {}
        if changes and not allow_config_change:
            shown = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in list(changes.items())[:6])
            raise ckpt.CheckpointError(
                f"{path} was saved with another config ({shown}); resuming would not continue that run exactly. "
                "Resume with the saved config (its config.yaml), start a new run (qerl train --fresh), or accept "
                "the change: Trainer.resume(allow_config_change=True) / qerl train --allow-config-change")
        ckpt.load_adapter_weights(self.model, path)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        ckpt.set_rng_state(state["rng"])
        if self.aqn is not None and state["aqn"] is not None:
            self.aqn.load_state_dict(state["aqn"])
        self.step = int(state["step"])
        self.history = json.loads(state["history"])
        self.run_id = state.get("run_id") or (runs.read_run(path) or {}).get("run_id") or self.run_id
        if changes:
            self._apply_config(changes, path)
        if self.dist.main and runs.read_run(self.output_dir) is None and \
                path.parent.resolve() == self.output_dir.resolve():
            runs.write_run(self.output_dir, self.run_id, "train")  # a run from before run.json: adopt it
        self.claim_output_dir()  # this run's directory now (another run there moves aside)
        if self.dist.main:  # the metrics file keeps exactly the checkpointed steps; later ones are redone
            (self.output_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in self.history))
        self.dist.barrier()
        return self.step

    def _apply_config(self, changes: dict, path: Path) -> None:
        """After a resume with ``allow_config_change``: this config's optimizer settings, lr schedule
        and AQN schedule, on the restored state (the RNG streams carry on), and a log line."""
        o = self.config.optim
        for group in self.optimizer.param_groups:
            for key in ("weight_decay", "eps"):
                if key in group and hasattr(o, key):
                    group[key] = getattr(o, key)
            if "betas" in group and hasattr(o, "betas"):
                group["betas"] = tuple(o.betas)
        self.set_lr(o.lr)  # base lr and the schedule (built from this config's total_steps)
        if self.aqn is not None:
            a = self.config.aqn
            self.aqn.sigma_start, self.aqn.sigma_end, self.aqn.stages = a.sigma_start, a.sigma_end, a.stages
            self.aqn.total_steps, self.aqn.resample = self.config.total_steps, a.resample
            self.aqn.allow_increasing = a.allow_increasing
        line = {"step": self.step, "checkpoint": str(path), "changes": {k: list(v) for k, v in changes.items()}}
        warnings.warn(f"resumed {path} with a changed config: {line['changes']}", stacklevel=3)
        if self.dist.main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            with open(self.output_dir / "config_changes.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")

