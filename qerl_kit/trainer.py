"""The GRPO/DAPO loop on a 4-bit base: rollouts under AQN, rewards, advantages, clipped updates.

``Trainer(model, tokenizer, task, config)`` owns all training state (optimizer, scheduler, step,
AQN, metrics), so ``train(steps)`` can be called again and again from a notebook, with a slider
changed in between (``trainer.set_lr(...)``, ``trainer.aqn.sigma_start``). The ``task``
(``qerl_kit.tasks.Task``) brings the rows, the reward functions and the prompt function; the
rollout engine is ``config.rollout.engine`` (``qerl_kit.rollout.make_engine``) unless given. One
step is five phases:

1. **collect**: sample ``batch_size / group_size`` rows (seeded by (seed, step), so a resumed run
   draws the same prompts), render and tokenize them once (``task.encode``), and inside
   ``engine.sync(policy, noise=aqn, step=step)`` generate ``group_size`` completions each: the
   engine receives the step's AQN noise and the current adapter (a no-op upload for engines that
   read the policy's memory; vLLM gets both), and the noise is gone before any training forward.
   With ``filters.dynamic_sampling``, groups whose rewards are all equal are dropped and more
   rounds are generated (``sampling_filters.accumulate_groups``, filling at the round limit);
2. **score**: TRL-style reward functions scored as evaluation scores them (``qerl_kit.scoring``), DAPO overlong shaping;
3. **prepare**: group-normalized advantages over the global batch and the reference's log-probs
   (adapter disabled) when ``beta > 0``; with ``loss.old_logp = "pass"`` also a separate no-grad pass
   for the clean policy's log-probs (``old``), entropy and truncated importance weights between the
   rollout log-probs (noisy, sampled) and the clean ones (``qerl_kit.old_policy``);
4. **update**: ``mu`` optimizer steps on the batch in micro-batches, the loss normalized as its
   ``grpo.LossSpec`` says, with gradient clipping and the lr schedule (a non-finite loss stops the
   run; a NaN/inf gradient norm skips the update, named and counted in ``update/skipped``: ``finite``).
   With ``loss.old_logp = "fold"`` (default) the first iteration's forward, at the pre-update
   parameters, also gives each micro-batch's old log-probs, entropy and IS weights;
5. **metrics**: TRL's names where one exists, a warning when the run diverges (``divergence``);
   every ``save_every`` steps a checkpoint (finite only) from which ``resume()`` continues exactly.

Launched by ``torchrun`` (or ``accelerate launch``) the same Trainer runs data-parallel: each
rank takes a slice of whole groups, advantages and loss normalizers are global, the adapter's
gradients are all-reduced by DDP, metrics are reduced, and rank 0 alone logs and checkpoints
(``qerl_kit.distributed``, docs/distributed.md).
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Callable, Sequence

import torch

from qerl_kit import checkpoint as ckpt
from qerl_kit import distributed
from qerl_kit import dense_update, divergence, finite, grpo, runs, trainer_state
from qerl_kit.aqn import AQN
from qerl_kit.config import TrainConfig, check_lr
from qerl_kit.data import DataError
from qerl_kit.evaluate import evaluate_task
from qerl_kit.logprobs import batched_logprobs, micro_batch_plan
from qerl_kit.old_policy import OldPolicy, resolve_mode
from qerl_kit.optim import lr_lambda, make_optimizer, steps_to_run
from qerl_kit.rollout.base import check_engine
from qerl_kit.engine_memory import static_options
from qerl_kit.rollout.registry import engine_options, make_engine
from qerl_kit.rollout.types import Rollouts, SamplingParams
from qerl_kit.sampling_filters import KeptGroups, accumulate_groups, overlong_penalty
from qerl_kit.scoring import score_rollouts
from qerl_kit.step_phases import Prepared, dense_block, phase_clock, step_metrics
from qerl_kit.tasks.task import Task


def _cuda_counters(device: torch.device) -> bool:
    """Whether the step's ``memory/*`` figures can be read: PyTorch's CUDA allocator counters, which
    count what goes through PyTorch's allocator (vLLM's own pool is not in them)."""
    return device.type == "cuda"


class Trainer:
    """GRPO/DAPO on a (quantized) LoRA model; see the module docstring for one step."""

    def __init__(self, model, tokenizer, task: Task, config: TrainConfig, *, engine=None, progress: str = "auto"):
        if not isinstance(task, Task):
            raise TypeError(f"Trainer(model, tokenizer, task, config) takes a qerl_kit.tasks.Task; got "
                            f"{type(task).__name__} (build one with qerl_kit.tasks.make_task(cfg.data) or "
                            "Task(name, train_rows, eval_rows, reward_fns, prompt_fn))")
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a qerl_kit.config.TrainConfig; got {type(config).__name__}")
        if not task.train:  # a DataError (a ValueError): `qerl train` prints it as one line
            raise DataError(f"task {task.name!r} has no training rows{(task.info or {}).get('no_train', '')}")
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("the model has no trainable parameters; attach LoRA first "
                             "(qerl_kit.lora.attach_lora)")
        self.model, self.tokenizer, self.config, self.task = model, tokenizer, config, task
        self.dist = distributed.Context.detect()  # world 1 unless launched by torchrun & co
        distributed.check_config(config, self.dist.world)
        # the StaticEngine's keep_cache / max_rows: as configured, or planned for this GPU (engine_memory)
        static, self.engine_memory = static_options(config, model, tokenizer, task, self.dist.world) \
            if engine is None else ({}, None)
        self.engine = check_engine(engine) if engine is not None else make_engine(
            config.rollout.engine, model, tokenizer, **engine_options(config.rollout, model, tokenizer, task, config.model.lora_r),
            **static)
        self.progress = progress
        self.aqn = AQN(config.aqn.sigma_start, config.aqn.sigma_end, config.aqn.stages,
                       config.total_steps, seed=config.seed, resample=config.aqn.resample,
                       allow_increasing=config.aqn.allow_increasing) \
            if config.aqn.enabled else None
        self.optimizer = make_optimizer(trainable, config.optim)
        self._grads = finite.GradGuard()  # NaN/inf gradient norms: skipped and named; repeated: an error
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config.optim, config.total_steps))
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
        self._old_logp = resolve_mode(config.loss.old_logp, model)  # "fold" unless a dropout needs "pass"
        self._device = next(p.device for p in trainable)  # where rollouts go before the log-prob phase

    # ---- the task's parts, as the loop reads them --------------------------------------------
    @property
    def dataset(self) -> list[dict]:
        return self.task.train

    @property
    def eval_dataset(self) -> list[dict]:
        return self.task.eval

    @property
    def reward_fns(self) -> tuple[Callable, ...]:
        return self.task.rewards

    @property
    def accuracy_fn(self) -> Callable:
        return self.task.accuracy

    # ---- controls a notebook can call between chunks ----------------------------------------
    def set_lr(self, lr: float) -> None:
        """Change the base learning rate (the schedule keeps multiplying it); checked as optim.lr is."""
        lr = check_lr("lr", lr)
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

    # ---- one step: collect -> score -> prepare -> update -> metrics ---------------------------
    def train_step(self) -> dict:
        start = time.perf_counter()
        cuda = _cuda_counters(self._device)
        if cuda:  # memory/peak_gib is this step's own: CUDA's peak counter restarts with each step
            torch.cuda.reset_peak_memory_stats(self._device)
        batch, rewards, metrics = self._collect(self.step)
        if cuda:  # host-side counters (no synchronization): the rollout's peak, what stays into the update
            metrics["memory/rollout_peak_gib"] = torch.cuda.max_memory_allocated(self._device) / dense_update.GIB
            metrics["memory/after_rollout_gib"] = torch.cuda.memory_allocated(self._device) / dense_update.GIB
        lc = self.config.loss  # the rows of each micro-batch, for the block, the passes and the update:
        plan = micro_batch_plan(batch.prompt_mask, batch.completion_mask, lc.micro_batch, lc.micro_batch_order)
        # the base's dense weights, made once for the log-prob passes + update, freed before the next rollout
        with dense_block(self.model, self.config, batch, self.engine, *plan) as cache:
            prep = self._prepare(batch, rewards, metrics, *plan)
            update = self._update(prep, metrics)
            metrics.update(self._metrics(prep, update))
        metrics["memory/dense_cache_gib"] = cache.peak_bytes / dense_update.GIB
        if cuda:
            metrics["memory/peak_gib"] = torch.cuda.max_memory_allocated(self._device) / dense_update.GIB
        metrics["time/step"] = time.perf_counter() - start
        self.step += 1
        return distributed.reduce_metrics(metrics, self.dist)  # the same row on every rank

    def _rows(self, step: int, round_: int = 0) -> list[dict]:
        g = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step * 101 + round_)
        idx = torch.randint(len(self.dataset), (self.config.rollout.prompts_per_step,), generator=g)
        return [self.dataset[i] for i in idx.tolist()]

    def _sampling(self, step: int, round_: int, first_group: int = 0) -> SamplingParams:
        r = self.config.rollout  # the seed also depends on the call's first global group (0 on one process)
        return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              seed=self.config.seed * 7919 + step * 31 + round_ + first_group * distributed.SEED_STRIDE)

    def _rollout(self, step: int, round_: int, metrics: dict) -> tuple[list[dict], Rollouts]:
        """One round's rows (this rank's whole groups) and their rollouts, under the step's sync."""
        rows = self._rows(step, round_)
        part = distributed.group_slice(len(rows), self.dist.rank, self.dist.world)
        rows = rows[part]
        prompts = self.task.encode(self.tokenizer, rows)
        with self.engine.sync(self.model, noise=self.aqn, step=step) as info:
            rollouts = self.engine.generate(prompts, self.config.rollout.group_size,
                                            self._sampling(step, round_, part.start))
        rollouts = rollouts.to(self._device)  # vLLM returns CPU tensors; a no-op for the other engines
        if self.aqn is not None:
            metrics["aqn/sigma"], metrics["aqn/stage"] = self.aqn.sigma(step), self.aqn.stage(step)
            metrics["aqn/norms"] = info.get("aqn/norms", 0)
        for key, name in (("sync/seconds", "time/sync"), ("sync/wake_seconds", "time/wake"),
                          ("sync/upload_seconds", "time/upload"), ("sync/sleep_seconds", "time/sleep")):
            if key in info:  # what a sync cost an engine with its own weights (vLLM)
                metrics[name] = metrics.get(name, 0.0) + info[key]
        return rows, rollouts

    def _collect(self, step: int) -> tuple[Rollouts, torch.Tensor, dict]:
        """Rollouts and rewards of the step's batch, with DAPO dynamic sampling when enabled."""
        cfg, G, fc = self.config, self.config.rollout.group_size, self.config.filters
        target = cfg.rollout.prompts_per_step // self.dist.world
        metrics: dict = {}
        state, rounds, t_rollout = KeptGroups(), [], 0.0
        while True:
            t0 = time.perf_counter()
            rows, rollouts = self._rollout(step, len(rounds), metrics)
            t_rollout += time.perf_counter() - t0
            rewards, reward_metrics, correct = self._score(rows, rollouts)
            if not rounds:
                metrics.update(reward_metrics)
                metrics["reward"], metrics["accuracy"] = rewards.nanmean().item(), correct.mean().item()
                metrics["frac_reward_zero_std"] = grpo.frac_reward_zero_std(rewards, G)
            rounds.append((rollouts, rewards))
            if not fc.dynamic_sampling:
                break
            items = [(len(rounds) - 1, i) for i in range(len(rollouts))]
            state, done = accumulate_groups(state, items, rewards, G, target, max_rounds=fc.max_sampling_rounds,
                                            exhausted="fill")
            if done:
                break
        metrics["time/rollout"] = t_rollout
        stats = rounds[-1][0].stats or {}
        metrics["rollout/tokens_per_s"] = stats.get("rollout/tokens_per_s", float("nan"))
        if not fc.dynamic_sampling:
            return rounds[0][0], rounds[0][1], metrics
        metrics["sampling/rounds"] = state.rounds
        metrics["sampling/filled_groups"] = state.groups_filled
        runs_: list[tuple[int, list[int]]] = []  # consecutive kept rows of one round
        for r, i in state.items():
            if runs_ and runs_[-1][0] == r:
                runs_[-1][1].append(i)
            else:
                runs_.append((r, [i]))
        batch = Rollouts.concat([rounds[r][0].select(idx) for r, idx in runs_])
        return batch, state.reward_tensor(), metrics

    def _score(self, rows: list[dict], rollouts: Rollouts) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """(rewards [B], per-function metrics, correct [B]) of one round's completions, DAPO-shaped."""
        rewards, metrics, correct = score_rollouts(self.task, rows, rollouts, self.config.rollout.group_size)
        fc = self.config.filters
        if fc.overlong_buffer > 0:
            rewards = rewards + overlong_penalty(rollouts.completion_lengths.cpu(), self.config.rollout.max_new_tokens,
                                                 fc.overlong_buffer, fc.overlong_penalty)
        return rewards, metrics, correct

    def _prepare(self, batch: Rollouts, rewards: torch.Tensor, metrics: dict, groups: list, bounds: list) -> Prepared:
        """Loss mask, global advantages, the reference's log-probs; the clean policy's when not folded."""
        lc, temp = self.config.loss, self.config.rollout.temperature
        mask = batch.completion_mask.float()
        if self.config.filters.mask_truncated:
            keep = torch.tensor([r != "length" for r in batch.finish_reasons], dtype=mask.dtype, device=mask.device)
            mask = mask * keep[:, None]
        all_rewards = self.dist.all_gather(rewards)  # the global batch's (= rewards on one process)
        mine = slice(self.dist.rank * len(rewards), (self.dist.rank + 1) * len(rewards))
        adv = grpo.group_advantages(all_rewards, self.config.rollout.group_size,
                                    scale=lc.scale_rewards)[mine].to(mask.device)  # rewards: CPU
        t0, ran = phase_clock(self._device), self._old_logp == "pass" or lc.beta > 0
        self.model.eval()
        old = OldPolicy(batch, mask, lc.is_correction, lc.is_cap)
        if self._old_logp == "pass":  # else the update's first iteration fills it
            metrics.update(old.run_pass(self.model, temp, groups, bounds))
        ref_logp = None
        if lc.beta > 0:
            with self.model.disable_adapter():
                ref_logp = batched_logprobs(self.model, batch, temp, groups, bounds=bounds)
        t1 = phase_clock(self._device)
        metrics["time/logprob"] = t1 - t0 if ran else 0.0  # what ran before the update
        return Prepared(batch, rewards, all_rewards, mask, adv, old, ref_logp, t1, groups, bounds)

    def _eps(self) -> tuple[float, float]:
        lc = self.config.loss
        return lc.eps_low, (lc.eps_low if lc.eps_high is None else lc.eps_high)  # the one pair loss and stats use

    def _update(self, prep: Prepared, metrics: dict) -> dict:
        """``mu`` optimizer steps on the prepared batch; returns loss, grad_norm and skipped steps."""
        lc, temp, mask = self.config.loss, self.config.rollout.temperature, prep.mask
        self.model.train()
        spec, n = grpo.LOSSES[lc.loss], mask.shape[0]
        eps_low, eps_high = self._eps()
        # the normalizers of the global batch: all ranks' tokens, W*n sequences, the widest completion
        normalizer = spec.batch_kwargs(self.dist.sum(mask.sum()).clamp(min=1),
                                       int(self.dist.max(torch.tensor(mask.shape[1]))))
        forward = self._ddp if self._ddp is not None else self.model
        skipped, loss_sum, grad_norm, seen = 0, 0.0, torch.tensor(0.0), []  # seen: each forward's logp, for the clip metrics
        for _ in range(lc.mu):
            loss_sum = 0.0
            self.optimizer.zero_grad(set_to_none=True)  # here, so a step stopped by an error leaves no gradient
            for i, sl in enumerate(prep.groups):  # each micro-batch's rows (logprobs.micro_batches)
                with distributed.no_sync(self._ddp, i < len(prep.groups) - 1):  # all-reduce once, after the last
                    logp = prep.old.forward(forward, sl, temp, prep.bounds[i])  # folded: also old_logp[sl], entropy, IS
                    seen.append((sl, logp.detach()))
                    part = [t if t is None else t[sl] for t in (prep.old.old_logp, prep.adv, prep.ref_logp, prep.old.is_weights)]
                    loss = spec.fn(logp, part[0], part[1], mask[sl], eps_low=eps_low, eps_high=eps_high, beta=lc.beta,
                                   ref_logp=part[2], is_weights=part[3], **normalizer)
                    loss = loss * spec.chunk_weight(logp.shape[0], n * self.dist.world)
                    loss_sum += finite.check_loss(loss.item(), self.step + 1, sl, [logp] + part, lc.beta, self.model)  # before backward
                    distributed.backward(loss, self.dist)
            if not prep.old.ready:  # the first iteration of a folded step filled every row
                metrics.update(prep.old.finish())
            params = [p for p in self.model.parameters() if p.requires_grad]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.config.optim.max_grad_norm)
            skipped += self._grads.step(self.optimizer, grad_norm, self.model, self.step + 1)  # 1: skipped
        self.scheduler.step()
        self.model.eval()
        metrics["time/update"] = phase_clock(self._device) - prep.ready_at
        return {"loss": loss_sum, "grad_norm": float(grad_norm), "skipped": skipped, "seen": seen}

    def _metrics(self, prep: Prepared, update: dict) -> dict:
        """The step's metrics after the update (``step_phases.step_metrics``)."""
        return step_metrics(prep, update, step=self.step + 1, lr=self.scheduler.get_last_lr()[0],
                            temperature=self.config.rollout.temperature, dist=self.dist, eps=self._eps())

    # ---- the loop ----------------------------------------------------------------------------
    def train(self, steps: int | None = None, callback: Callable[[dict], None] | None = None) -> "Trainer":
        """Run ``steps`` more steps (default: up to ``config.total_steps``); callable repeatedly."""
        steps = steps_to_run("steps", self.config, self.step, steps)  # none past total_steps at lr 0
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
            divergence.note(self.history, warn=self.dist.main)  # reward collapsing, entropy exploding: row["warning"]
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
        data = dataset if dataset is not None else self.eval_dataset
        if not data:
            raise ValueError(f"no evaluation rows: task {self.task.name!r} has none; pass dataset=")
        kwargs.setdefault("temperature", 0.0)
        kwargs.setdefault("max_new_tokens", self.config.rollout.max_new_tokens)
        return evaluate_task(self.task, self.model, self.tokenizer, data, engine=self.engine, **kwargs)

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
            finite.check_weights(self.model, path, "the adapter for", True, "the checkpoint was not written")
            state = {"step": self.step, "optimizer": self.optimizer.state_dict(),
                     "scheduler": self.scheduler.state_dict(), "rng": trainer_state.rng_state(),
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
        changes = {}
        if "config" in state:
            saved = json.loads(state["config"])
            changes = ckpt.config_changes(saved, current, defaults)
        if changes and not allow_config_change:
            shown = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in list(changes.items())[:6])
            raise ckpt.CheckpointError(
                f"{path} was saved with another config ({shown}); resuming would not continue that run exactly. "
                "Resume with the saved config (its config.yaml), start a new run (qerl train --fresh), or accept "
                "the change: Trainer.resume(allow_config_change=True) / qerl train --allow-config-change")
        # optimizer, scheduler, RNG, AQN and adapter, all or nothing; a failure names the file and key
        trainer_state.restore(state, path, self.model, self.optimizer, self.scheduler, self.aqn, self.config.total_steps,
                              self.config.optim.schedule)
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
            a = self.config.aqn  # all at once: one value at a time may pass through a refused schedule
            self.aqn.update(sigma_start=a.sigma_start, sigma_end=a.sigma_end, stages=a.stages, resample=a.resample,
                            total_steps=self.config.total_steps, allow_increasing=a.allow_increasing)
        line = {"step": self.step, "checkpoint": str(path), "changes": {k: list(v) for k, v in changes.items()}}
        warnings.warn(f"resumed {path} with a changed config: {line['changes']}", stacklevel=3)
        if self.dist.main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            with open(self.output_dir / "config_changes.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")

