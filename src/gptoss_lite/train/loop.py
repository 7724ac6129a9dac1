"""The training loop: AdamW, warmup + cosine, grad clipping, BF16 autocast, checkpoints, DDP (docs/training.md).

Layout of `checkpoint.out_dir`:

```
checkpoints/step_0000500/   config.json + model.safetensors (save_model), optimizer.safetensors,
                            trainer_state.json (step, optimiser scalars, RNG, config)
final/                      config.json + model.safetensors of the last step
metrics.jsonl               one JSON line per logged step
```

NOTE: nothing is pickled: optimiser tensors (and the torch RNG state) go to safetensors, scalars to
JSON. Under `torchrun` (WORLD_SIZE > 1) training is data-parallel (gloo on CPU, NCCL on GPU): rank
0's weights are broadcast at the start, every rank draws its own rows of the data stream, gradients
are averaged across ranks after each step's backward passes (`_average_gradients`), and only rank 0
writes.

NOTE: not torch's DistributedDataParallel wrapper. With torch 2.13 that wrapper keeps the process
group alive after destroy_process_group (so does an optimiser built after init_process_group, hence
the order in `train`), and gloo's threads then survive into interpreter shutdown, where CI once saw
rank 1 abort ("terminate called without an active exception") after a finished run. A test checks
that no gloo thread outlives `train`. One all-reduce per step also needs no find_unused_parameters
traversal for experts that get no token. The price is no overlap of communication with backward,
which a CPU demo does not miss.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gptoss_lite.train.config import DataConfig, TrainConfig
from gptoss_lite.train.data import SyntheticRetrievalData, pose_positions

CHECKPOINT_DIR = "checkpoints"
FINAL_DIR = "final"
METRICS_FILE = "metrics.jsonl"
STATE_FILE = "trainer_state.json"
LOCK_FILE = ".train.lock"  # holds the pid of the run writing the directory (flock'd while it runs)
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
STATE_FORMAT_VERSION = 1


@dataclass
class TrainSummary:
    """What a finished run reports."""

    start_step: int  # first optimiser step this process ran (> 0 after a resume)
    end_step: int  # optimiser steps completed in total
    losses: list[float] = field(default_factory=list)  # LM loss of each step run here
    aux_losses: list[float] = field(default_factory=list)  # unscaled aux loss of each step run here
    tokens_per_s: float = 0.0  # training throughput over this process's steps, all ranks together
    out_dir: str = ""
    final_dir: str | None = None  # None on ranks other than 0

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None


# ---- distributed helpers ---------------------------------------------------------------------------


def _dist_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the torchrun environment (1 process without it)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))


def _resolve_device(config: TrainConfig, local_rank: int) -> torch.device:
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available; use device: cpu or auto")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _broadcast_parameters(model: torch.nn.Module) -> None:
    """Every rank starts from rank 0's parameters and buffers."""
    import torch.distributed as dist

    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=0)


def _pose(data: DataConfig, step: int, micro: int, rank: int) -> torch.Tensor | None:
    """The full layers' positions for one micro-batch under PoSE (None without it): drawn from (data
    seed, step, micro-step, rank) alone, so a resumed run sees the same positions."""
    if data.pose_length is None:
        return None
    rng = random.Random(f"pose:{data.seed}:{step}:{micro}:{rank}")
    return pose_positions(data.seq_len, data.pose_length, data.pose_chunks, rng, data.pose_anchor)


def _average_gradients(params: list[torch.nn.Parameter], world: int) -> None:
    """Replace each gradient by its mean over the ranks, in one all-reduce.

    A parameter with no gradient on this rank (a routed expert that got no token) contributes zeros;
    it ends with a gradient if any rank had one, and with none (skipped by the optimiser) if no rank did.
    """
    import torch.distributed as dist

    device = params[0].device
    has_grad = torch.tensor([float(p.grad is not None) for p in params], device=device)
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params] + [has_grad]
    )
    dist.all_reduce(flat)
    n_values = flat.numel() - len(params)
    flat[:n_values] /= world
    present = (flat[n_values:] > 0).tolist()  # one device sync, not one per parameter
    offset = 0
    for p, keep in zip(params, present):
        n = p.numel()
        p.grad = flat[offset : offset + n].view(p.shape).to(p.dtype) if keep else None
        offset += n


# ---- optimiser -------------------------------------------------------------------------------------


def _build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm weights, biases and sinks are not decayed)."""
    decay, no_decay = [], []
    for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    opt = config.optimizer
    groups = [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps)


def _save_optimizer(optimizer: torch.optim.Optimizer, directory: Path) -> dict:
    """Write optimiser tensors to safetensors; return its scalar state for the JSON file."""
    from safetensors.torch import save_file

    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, per_param in state["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{name}"] = value.detach().to("cpu").contiguous()
            else:
                scalars[f"{idx}.{name}"] = value
    save_file(tensors, str(directory / OPTIMIZER_FILE))
    return {"param_groups": state["param_groups"], "scalars": scalars}


def _read_optimizer(optimizer: torch.optim.Optimizer, directory: Path, saved) -> dict:
    """The optimiser state dict of a checkpoint, checked against `optimizer`; nothing is changed."""
    path = directory / OPTIMIZER_FILE
    tensors = _read_safetensors(path)
    if not (
        isinstance(saved, dict)
        and isinstance(saved.get("param_groups"), list)
        and isinstance(saved.get("scalars"), dict)
    ):
        raise ValueError(f"{directory / STATE_FILE}: 'optimizer' must hold 'param_groups' and 'scalars'")
    current = optimizer.state_dict()["param_groups"]
    groups = saved["param_groups"]
    if len(groups) != len(current) or any(
        not isinstance(g, dict) or g.get("params") != c["params"] or set(g) != set(c) for g, c in zip(groups, current)
    ):
        raise ValueError(f"{directory / STATE_FILE}: optimizer param_groups do not match this model's parameters")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_param: dict[int, dict] = {}
    for source, items in ((path, tensors.items()), (directory / STATE_FILE, saved["scalars"].items())):
        for key, value in items:
            idx, _, name = key.partition(".")
            if not idx.isdigit() or not name or int(idx) >= len(params):
                raise ValueError(
                    f"{source}: entry {key!r} names no parameter of this model "
                    f"(expected '<0..{len(params) - 1}>.<name>')"
                )
            per_param.setdefault(int(idx), {})[name] = value
    for idx, entries in per_param.items():
        for name in ("exp_avg", "exp_avg_sq"):
            value = entries.get(name)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(params[idx].shape):
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else value
                raise ValueError(
                    f"{path}: {idx}.{name} is {got}, expected a tensor of shape {tuple(params[idx].shape)}"
                )
        if "step" not in entries:
            raise ValueError(f"{path}: {idx}.step is missing")
    return {"state": per_param, "param_groups": groups}


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise ValueError(f"{path}: file not found")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None


# ---- checkpoints -----------------------------------------------------------------------------------


def _checkpoint_name(step: int) -> str:
    return f"step_{step:07d}"


def _step_dirs(root: Path) -> list[Path]:
    """The `step_<n>` directories directly under `root`, oldest first (hidden temp and trash dirs excluded)."""
    if not root.is_dir():
        return []
    steps = {d: d.name.removeprefix("step_") for d in root.iterdir() if d.is_dir() and d.name.startswith("step_")}
    return sorted((d for d, n in steps.items() if n.isdigit()), key=lambda d: int(steps[d]))


def checkpoints_newest_first(out_dir: str | Path) -> list[Path]:
    """Checkpoint directories under `out_dir/checkpoints` holding a trainer state, newest first."""
    return [d for d in reversed(_step_dirs(Path(out_dir) / CHECKPOINT_DIR)) if (d / STATE_FILE).is_file()]


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under `out_dir/checkpoints`, or None."""
    found = checkpoints_newest_first(out_dir)
    return found[0] if found else None


def _save_checkpoint(model, optimizer, config: TrainConfig, step: int, out_dir: Path) -> Path:
    """Write a checkpoint atomically (temp dir, then rename) and prune old ones."""
    from gptoss_lite.checkpoint import save_model

    root = out_dir / CHECKPOINT_DIR
    final = root / _checkpoint_name(step)
    tmp = root / f".tmp-{final.name}"  # hidden: never taken for a checkpoint
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, tmp, extra_config=_extra_config(config, step))
    opt_state = _save_optimizer(optimizer, tmp)
    from safetensors.torch import save_file

    save_file({"cpu_rng": torch.get_rng_state()}, str(tmp / RNG_FILE))
    state = {"format_version": STATE_FORMAT_VERSION, "step": step, "optimizer": opt_state, "config": config.to_dict()}
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in _step_dirs(root)[: -config.checkpoint.keep]:
        # Renamed out of the step_* namespace first: a kill mid-delete leaves hidden debris, never a
        # half-deleted directory that still looks like a checkpoint.
        trash = root / f".old-{old.name}"
        shutil.rmtree(trash, ignore_errors=True)
        old.rename(trash)
        shutil.rmtree(trash)
    return final


def _read_checkpoint(model, optimizer, directory: Path) -> dict:
    """Everything a resume from `directory` needs, fully checked; changes nothing (ValueError naming the file)."""
    from gptoss_lite.checkpoint.native import read_weights_for

    path = directory / STATE_FILE
    try:
        state = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable trainer state ({e})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(state).__name__}")
    if state.get("format_version") != STATE_FORMAT_VERSION:
        raise ValueError(
            f"{path}: trainer state format {state.get('format_version')!r}, "
            f"expected {STATE_FORMAT_VERSION}; start a new run without --resume"
        )
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{path}: 'step' is {step!r}; expected the int step the checkpoint was written at")
    if directory.name.startswith("step_") and directory.name != _checkpoint_name(step):
        raise ValueError(f"{path}: 'step' is {step} but the directory is {directory.name}")
    weights = read_weights_for(model, directory)  # config, names, shapes, finiteness
    optim = _read_optimizer(optimizer, directory, state.get("optimizer"))
    rng = _read_safetensors(directory / RNG_FILE).get("cpu_rng")
    expected = torch.get_rng_state()
    if not isinstance(rng, torch.Tensor) or rng.dtype != expected.dtype or rng.shape != expected.shape:
        raise ValueError(
            f"{directory / RNG_FILE}: 'cpu_rng' must be a {expected.dtype} tensor of shape {tuple(expected.shape)}"
        )
    return {"step": step, "weights": weights, "optimizer": optim, "rng": rng}


def _load_checkpoint(model, optimizer, directory: Path) -> int:
    """Restore model, optimiser and RNG from `directory`; returns the step to continue from.

    Everything is read and checked first, so a checkpoint that fails leaves model and optimiser as they were.
    """
    ckpt = _read_checkpoint(model, optimizer, directory)
    with torch.no_grad():
        for name, target in model.state_dict().items():
            target.copy_(ckpt["weights"][name])
    optimizer.load_state_dict(ckpt["optimizer"])
    torch.set_rng_state(ckpt["rng"])
    return ckpt["step"]


def _resume_from_newest_intact(model, optimizer, out_dir: Path, is_main: bool) -> tuple[Path, int]:
    """Load the newest checkpoint that reads back whole; a corrupt newer one is skipped with a warning."""
    problems = []
    for directory in checkpoints_newest_first(out_dir):
        try:
            step = _load_checkpoint(model, optimizer, directory)
        except ValueError as e:
            problems.append(f"{directory.name}: {e}")
            if is_main:
                print(
                    f"train: warning: checkpoint {directory} is unusable, trying the previous one ({e})",
                    file=sys.stderr,
                )
            continue
        return directory, step
    raise ValueError(f"--resume: no usable checkpoint under {out_dir / CHECKPOINT_DIR}: " + "; ".join(problems))


# ---- the loop --------------------------------------------------------------------------------------


def train(
    config: TrainConfig, resume: bool = False, max_steps: int | None = None, progress: bool = True
) -> TrainSummary:
    """Train `config.model` on synthetic retrieval data; see the module docstring for outputs.

    `resume`: continue from the newest checkpoint in `config.checkpoint.out_dir` (error when none).
    `max_steps`: stop once this many optimiser steps are done in total (the lr schedule still spans
    `schedule.total_steps`); None runs to `schedule.total_steps`.
    """
    from gptoss_lite.model import GPTOSS

    if max_steps is not None and max_steps < 1:
        raise ValueError(f"max_steps={max_steps}: must be >= 1 (or None to run schedule.total_steps)")
    end_step = config.schedule.total_steps if max_steps is None else min(max_steps, config.schedule.total_steps)
    out_dir = Path(config.checkpoint.out_dir)
    check_out_dir(out_dir)
    resume_dir = latest_checkpoint(out_dir) if resume else None
    if resume and resume_dir is None:
        raise FileNotFoundError(
            f"--resume: no checkpoint under {out_dir / CHECKPOINT_DIR}; run once without --resume first"
        )

    rank, world, local_rank = _dist_env()
    distributed = world > 1
    device = _resolve_device(config, local_rank)
    is_main = rank == 0
    if distributed and device.type == "cuda":
        torch.cuda.set_device(device)

    torch.manual_seed(config.seed)  # same initial weights on every rank
    model = GPTOSS(config.model).to(device)
    # NOTE: built before the process group: an optimiser constructed after init_process_group keeps
    # the group alive past destroy_process_group (torch 2.13; tests/train: no gloo thread survives).
    optimizer = _build_optimizer(model, config)
    start_step = 0
    if config.init_from is not None and resume_dir is None:
        from gptoss_lite.checkpoint.native import ROPE_CHANGE_FIELDS, load_weights_into

        # The context a checkpoint was trained at is its record, not its shape: a later stage may train
        # at another length (a length curriculum). The rotary settings change only when asked.
        allow = ROPE_CHANGE_FIELDS if config.init_rope_change else frozenset({"train_context_length"})
        load_weights_into(model, config.init_from, allow)  # strict: every tensor, shapes checked, or nothing
    if resume_dir is not None:
        # load_state_dict copies into the device parameters; the optimiser casts its state to them.
        resume_dir, start_step = _resume_from_newest_intact(model, optimizer, out_dir, is_main)
    lock = _lock_out_dir(out_dir) if is_main else None
    if is_main:
        try:
            # Lines past the starting step belong to work that is redone now (all of them on a fresh start).
            _truncate_metrics(out_dir / METRICS_FILE, start_step)
        except BaseException:
            if lock is not None:
                lock.close()
            raise
    model.train()
    model.gradient_checkpointing = config.gradient_checkpointing
    params = [p for p in model.parameters() if p.requires_grad]
    if distributed:
        import torch.distributed as dist

        owns_group = not dist.is_initialized()
        if owns_group:
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        _broadcast_parameters(model)

    accum = config.optimizer.grad_accum_steps
    data = SyntheticRetrievalData(config.data, rank=rank, world_size=world, grad_accum_steps=accum)
    autocast = (
        torch.autocast(device_type=device.type, dtype=torch.bfloat16) if config.precision == "bf16" else nullcontext()
    )
    tokens_per_step = config.data.batch_size * config.data.seq_len * accum * world
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        print(
            f"train: {sum(p.numel() for p in model.parameters()):,} parameters, seq_len {config.data.seq_len}, "
            f"{tokens_per_step:,} tokens/step, {world} process(es) on {device}, precision {config.precision}, "
            f"steps {start_step}->{end_step}" + (f" (resumed from {resume_dir})" if resume_dir else ""),
            file=sys.stderr,
        )

    summary = TrainSummary(start_step=start_step, end_step=start_step, out_dir=str(out_dir))
    bar = None
    if is_main and progress:
        from tqdm import tqdm

        bar = tqdm(total=end_step, initial=start_step, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)
    metrics = open(out_dir / METRICS_FILE, "a") if is_main else None
    t_start = time.perf_counter()
    try:
        for step in range(start_step, end_step):
            t0 = time.perf_counter()
            lr = config.optimizer.lr * config.schedule.lr_factor(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            aux_sum = torch.zeros((), device=device)
            for micro in range(accum):
                inputs, targets = data.batch(step, micro)  # (B, T), (B, T)
                inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
                positions = _pose(config.data, step, micro, rank)
                with autocast:
                    out = model(inputs, targets=targets, full_positions=positions)
                lm_loss, aux_loss = out.loss.float(), out.aux_loss.float()
                total = (lm_loss + config.aux_loss_coef * aux_loss) / accum
                total.backward()
                loss_sum += lm_loss.detach() / accum
                aux_sum += aux_loss.detach() / accum
            if distributed:
                _average_gradients(params, world)
            if config.optimizer.grad_clip is not None:
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.grad_clip)
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if distributed:
                import torch.distributed as dist

                stats = torch.stack([loss_sum, aux_sum])
                dist.all_reduce(stats)
                loss_sum, aux_sum = stats[0] / world, stats[1] / world
            loss_value, aux_value = float(loss_sum), float(aux_sum)
            if not math.isfinite(loss_value):
                raise FloatingPointError(
                    f"step {step}: loss is {loss_value}; lower optimizer.lr "
                    f"(now {config.optimizer.lr}) or use precision: fp32"
                )
            done = step + 1
            dt = time.perf_counter() - t0
            summary.losses.append(loss_value)
            summary.aux_losses.append(aux_value)
            summary.end_step = done
            if bar is not None:
                bar.update(1)
                bar.set_postfix(
                    loss=f"{loss_value:.4f}",
                    aux=f"{aux_value:.3f}",
                    lr=f"{lr:.2e}",
                    tok_s=f"{tokens_per_step / dt:,.0f}",
                )
            if metrics is not None and (done % config.logging.every_n_steps == 0 or done == end_step):
                metrics.write(
                    json.dumps(
                        {
                            "step": done,
                            "loss": loss_value,
                            "aux_loss": aux_value,
                            "lr": lr,
                            "grad_norm": float(grad_norm),
                            "tokens_per_s": tokens_per_step / dt,
                            "elapsed_s": time.perf_counter() - t_start,
                        }
                    )
                    + "\n"
                )
                metrics.flush()
            if is_main and done % config.checkpoint.every_n_steps == 0 and done < end_step:
                _save_checkpoint(model, optimizer, config, done, out_dir)
        elapsed = time.perf_counter() - t_start
        ran = summary.end_step - start_step
        summary.tokens_per_s = tokens_per_step * ran / elapsed if ran and elapsed > 0 else 0.0
        if is_main:
            if summary.end_step > start_step:
                _save_checkpoint(model, optimizer, config, summary.end_step, out_dir)
            from gptoss_lite.checkpoint import save_model

            final = out_dir / FINAL_DIR
            save_model(model, final, extra_config=_extra_config(config, summary.end_step))
            summary.final_dir = str(final)
            print(
                f"train: done at step {summary.end_step}; final loss {summary.final_loss}; "
                f"{summary.tokens_per_s:,.0f} tokens/s; model in {final}",
                file=sys.stderr,
            )
    finally:
        if lock is not None:
            lock.close()  # releases the flock
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
        if distributed:
            import torch.distributed as dist

            dist.barrier()
            if owns_group:
                dist.destroy_process_group()
    return summary


def _extra_config(config: TrainConfig, step: int) -> dict:
    """config.json keys beside the model: the tokenizer and how the weights were trained."""
    return {
        "tokenizer": "byte",
        "training": {
            "step": step,
            "seq_len": config.data.seq_len,
            "data_seed": config.data.seed,
            "precision": config.precision,
        },
    }


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metrics lines past `step` (left by a run that stopped after its last checkpoint).

    A partial last line (a crash mid-write) is dropped with a warning; a damaged line elsewhere is a
    ValueError naming the file and line. The file is replaced atomically.
    """
    if not path.is_file():
        return
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None
    raw = text.split("\n")
    complete, tail = raw[:-1], raw[-1]  # tail: text after the last newline (a partial line, or "")
    kept = []
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            line_step = entry["step"]
            if isinstance(line_step, bool) or not isinstance(line_step, int):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            if number == len(complete) and not tail.strip():
                tail = line  # the last line, damaged: same as a partial one
                continue
            raise ValueError(
                f"{path}:{number}: not a metrics line ({line[:60]!r}); repair or delete the line, then resume again"
            ) from None
        if line_step <= step:
            kept.append(line)
    if tail.strip():
        print(
            f"train: warning: {path}: dropped a partial last line ({tail[:60]!r}) left by an interrupted write",
            file=sys.stderr,
        )
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def _lock_out_dir(out_dir: Path):
    """Hold an exclusive lock on `out_dir` for this run: two trainers writing one directory would
    interleave checkpoints and metrics. The kernel drops the lock when the process ends, SIGKILL included.
    Returns the open lock file (close it to release), or None where `fcntl` does not exist (Windows)."""
    try:
        import fcntl
    except ImportError:  # no flock on this platform: nothing to lock with
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = open(out_dir / LOCK_FILE, "a+")
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise ValueError(
            f"{out_dir}: another train run (pid {holder}) is writing this directory; wait for it, "
            "stop it, or choose another --out"
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def check_out_dir(out_dir: Path) -> None:
    """Refuse an output directory that cannot be created, before anything is written."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(
            f"output directory {out_dir}: exists and is a file; choose another --out (or checkpoint.out_dir)"
        )
    for parent in (out_dir, *out_dir.parents):
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(
                    f"output directory {out_dir}: {parent} is a file, not a directory; "
                    "choose another --out (or checkpoint.out_dir)"
                )
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ValueError(f"output directory {out_dir}: {parent} is not writable; choose another --out")
            break
