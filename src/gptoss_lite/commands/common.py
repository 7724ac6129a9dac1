"""Helpers shared by command handlers: model/tokenizer resolution, devices, threads, units."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gptoss_lite.kvspec import BY_BITS, FORMATS

# `--threads` above this is refused: torch accepts it, then runs hundreds of spinning OpenMP threads.
MAX_THREADS = 1024


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="model directory (ours or a Hugging Face gpt-oss checkpoint) or a preset name "
        "(seeded random weights); default: the shipped demo model",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="dense weight/activation dtype (default: auto, the checkpoint's own: float32 for the demo model "
        "and presets, bfloat16 for gpt-oss; MXFP4 experts stay packed either way)",
    )
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")
    parser.add_argument(
        "--mxfp4-activations",
        choices=("exact", "int8"),
        default="exact",
        help="how packed MXFP4 experts (gpt-oss on a CPU) multiply decode rows: exact (default) or int8, "
        "each block of 32 inputs rounded to int8 first as llama.cpp does (faster products; results "
        "change by that rounding)",
    )
    parser.add_argument(
        "--rope-factor",
        type=float,
        default=None,
        metavar="F",
        help="override the model's YaRN factor at load: the same weights stretched to a rotary target of "
        "F x its original context, positions accepted up to twice that (default: the checkpoint's own)",
    )
    add_threads_arg(parser)


def torch_dtype(name: str):
    """--dtype as a torch.dtype, None for auto (the checkpoint's own)."""
    import torch

    return None if name == "auto" else getattr(torch, name)


def add_compile_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile",
        action="store_true",
        help="run decode steps as one compiled graph (torch.compile); the first run of a model shape "
        "compiles for about a minute, later runs load it from inductor's disk cache in seconds",
    )


def add_eval_batch_args(parser: argparse.ArgumentParser, batch: str) -> None:
    """--prefill-chunk and --batch-size of the evaluations; `batch` says which trials go together."""
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=2048,
        metavar="TOKENS",
        help="prompt tokens per prefill forward (default: 2048)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=8, metavar="N", help=f"trials generated together ({batch}; default: 8)"
    )


def add_threads_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="CPU threads for torch (default: $OMP_NUM_THREADS if set, else one per "
        "physical core this process may use, minus cores the load average says are busy)",
    )


# ---- threads -------------------------------------------------------------------------------------------


def available_cpus() -> set[int]:
    """Logical CPUs this process may run on (its affinity mask; all CPUs where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int]) -> int:
    """Physical cores among `cpus` (hyper-threads of one core count once); len(cpus) if unknown."""
    cores = set()
    for cpu in cpus:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            cores.add(siblings.read_text().strip())
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def default_threads(load_aware: bool = True) -> tuple[int, str]:
    """(threads, why): $OMP_NUM_THREADS when set, else the physical cores available to us, less the
    busy ones when `load_aware` (>= 1). Training passes load_aware=False: its thread count changes
    how reductions round, so it must not depend on what else the machine is doing."""
    env = os.environ.get("OMP_NUM_THREADS")
    if env is not None and env.strip():
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"OMP_NUM_THREADS={env!r}: must be an int >= 1; unset it or pass --threads N")
        return n, "OMP_NUM_THREADS"
    cpus = available_cpus()
    cores = min(physical_cores(cpus), len(cpus))
    busy = 0
    if load_aware and hasattr(os, "getloadavg"):
        # Runnable tasks beyond our own: OpenMP threads that share a core with them spin and stall.
        busy = int(os.getloadavg()[0] + 0.5)
    return max(1, min(cores, len(cpus) - busy)), f"{cores} physical core(s), load {busy}"


def configure_threads(requested: int | None, load_aware: bool = True) -> int:
    """Set torch's intra-op threads from --threads (or the default above); returns the count."""
    import torch

    from gptoss_lite.validation import check_int

    if requested is None:
        n, _ = default_threads(load_aware)
    else:
        n = check_int("--threads", requested, 1, MAX_THREADS)
    torch.set_num_threads(n)
    return n


# ---- devices -------------------------------------------------------------------------------------------


def resolve_device(text: str):
    """--device as a torch.device that this torch build can use now, else a ValueError saying why."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"--device {text!r}: not a torch device; use cpu, cuda, cuda:N or mps") from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if torch.version.cuda is None:
            raise ValueError(
                f"--device {text}: this torch ({torch.__version__}) is a CPU-only build; install a CUDA "
                "build of PyTorch (see the README) or use --device cpu"
            )
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {text}: no CUDA device is visible (driver or CUDA_VISIBLE_DEVICES); use --device cpu"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {text}: only {count} CUDA device(s), cuda:0..cuda:{count - 1}")
        return device
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"--device {text}: MPS is not available on this machine; use --device cpu")
        return device
    raise ValueError(f"--device {text!r}: unsupported device type {device.type!r}; use cpu, cuda, cuda:N or mps")


# ---- models --------------------------------------------------------------------------------------------


def load_model_and_tokenizer(args: argparse.Namespace):
    """Resolve --model (default: the shipped demo model), its tokenizer, --device and --threads.

    Everything that can be checked from the config is checked before any weight is built or read,
    so a model the tokenizer cannot serve fails at once instead of after generating.
    """

    from gptoss_lite.checkpoint import default_model_source, load_model
    from gptoss_lite.checkpoint.native import read_model_config
    from gptoss_lite.tokenizer import ByteTokenizer, load_tokenizer

    device = resolve_device(args.device)
    args.threads = configure_threads(getattr(args, "threads", None))
    source = args.model if args.model is not None else default_model_source()
    model_dir = source if _is_dir(source) else None
    tokenizer = load_tokenizer(model_dir)
    cfg, _ = read_model_config(source)  # the same errors load_model gives, before any weight is read
    rope_factor = getattr(args, "rope_factor", None)
    if rope_factor is not None:
        try:
            cfg = cfg.with_rope_factor(rope_factor)
        except ValueError as e:
            raise ValueError(f"--rope-factor: {e}") from None
    if isinstance(tokenizer, ByteTokenizer) and cfg.vocab_size != tokenizer.vocab_size:
        where = f"{source} has no tokenizer.json" if model_dir is not None else f"preset {source!r} has no tokenizer"
        raise ValueError(
            f"--model {source}: vocab_size={cfg.vocab_size:,} but {where}, and the byte tokenizer "
            f"reads only ids 0..{tokenizer.vocab_size - 1}; put the model's tokenizer.json in its "
            "directory or use a byte-vocabulary model (vocab_size 264, e.g. lite-tiny)"
        )
    model = load_model(
        source,
        device=device,
        dtype=torch_dtype(args.dtype),
        rope_factor=rope_factor,
        mxfp4_activations=getattr(args, "mxfp4_activations", "exact"),
    )
    if getattr(args, "compile", False):
        model.prepare_for_inference(compile_decode=True)
    return model, tokenizer, source


def _is_dir(source) -> bool:
    return Path(str(source)).is_dir()


# ---- output files ---------------------------------------------------------------------------------------


def check_plot_file(flag: str, path: str) -> None:
    """`check_output_file`, and matplotlib importable: checked before an evaluation that can take hours,
    so a bad path or a missing extra never throws results away."""
    check_output_file(flag, path)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"{flag} {path}: needs matplotlib; pip install 'gptoss-lite[plot]' or drop {flag}") from None


def check_output_file(flag: str, path: str) -> None:
    """Refuse, before any work, an output file that could not be written afterwards."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file name such as {target / 'out.png'}")
    parent = target.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: directory {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {path}: directory {parent} is not writable; choose another path")
    if target.exists() and not os.access(target, os.W_OK):
        raise ValueError(f"{flag} {path}: file exists and is not writable; choose another path")


def write_text_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same directory and a rename, so a reader
    (or a crash) never sees half a file."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, target)


def fmt_bytes(n: int) -> str:
    """Binary units (KiB/MiB/GiB), as docs/plan.md#units-and-labels requires for memory sizes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def warn(command: str, message: str) -> None:
    print(f"gptoss-lite {command}: {message}", file=sys.stderr)


def add_decode_steps_arg(parser: argparse.ArgumentParser) -> None:
    """`--decode-steps N` of the server commands: decode bursts (docs/engine.md#decode-bursts), 1 by
    default so that tokens stream one at a time (the library's `LLM` takes 8)."""
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=1,
        help="decode tokens a request may run per scheduling round while all decode greedily and none waits "
        "(default: 1; the library's LLM: 8)",
    )


def add_speculate_args(parser: argparse.ArgumentParser) -> None:
    """--speculate {none,lookup,draft:PATH} and --draft-tokens K."""
    parser.add_argument(
        "--speculate",
        default="none",
        metavar="{none,lookup,draft:PATH}",
        help="speculative decoding: 'lookup' drafts by n-gram lookup in the prompt and the "
        "generated text, 'draft:PATH' with a smaller model of the same vocabulary "
        "(checkpoint directory or preset name); greedy output is unchanged "
        "(default: none)",
    )
    parser.add_argument(
        "--draft-tokens",
        type=int,
        default=None,
        metavar="K",
        help="tokens drafted per step, verified in one forward (default: 8 for lookup, 4 for a draft model)",
    )


def build_speculation(args: argparse.Namespace, model):
    """The `speculate=` argument for generate() from --speculate / --draft-tokens (None for 'none');
    a draft model is loaded like --model, on the same device and dtype."""

    from gptoss_lite.speculative import DraftModel, PromptLookup

    check_speculate_args(args)
    mode, k = args.speculate, args.draft_tokens
    if mode == "none":
        return None
    if mode == "lookup":
        return PromptLookup() if k is None else PromptLookup(k=k)
    from gptoss_lite.checkpoint import load_model

    draft = load_model(mode[len("draft:") :], device=args.device, dtype=torch_dtype(args.dtype))
    if draft.config.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"--speculate {mode}: the draft's vocab_size {draft.config.vocab_size} differs "
            f"from the model's {model.config.vocab_size}; use a draft with the same tokenizer"
        )
    return DraftModel(draft) if k is None else DraftModel(draft, k=k)


def speculation_label(args: argparse.Namespace, llm) -> str:
    """How the engine speculates, for the start-up line and the benchmark report."""
    spec = llm.speculate
    if args.speculate == "lookup":
        return f"lookup k={spec.k}"
    return f"draft model {args.speculate[len('draft:') :]} k={spec.k}"


def check_speculate_args(args: argparse.Namespace) -> None:
    """--speculate / --draft-tokens checks that need no model (run before loading it)."""
    mode, k = args.speculate, args.draft_tokens
    if k is not None and (isinstance(k, bool) or k < 1):
        raise ValueError(f"--draft-tokens {k}: must be >= 1")
    if mode == "none" and k is not None:
        raise ValueError("--draft-tokens needs --speculate lookup or --speculate draft:PATH")
    if mode not in ("none", "lookup") and not (mode.startswith("draft:") and mode[len("draft:") :]):
        raise ValueError(
            f"--speculate {mode!r}: use none, lookup or draft:PATH (a checkpoint directory or preset name)"
        )


def speculation_line(stats) -> str:
    """One line for --stats: acceptance rate and tokens per target forward."""
    return (
        f"speculation: {stats.accepted}/{stats.drafted} drafted tokens accepted "
        f"({100 * stats.acceptance_rate:.1f}%), {stats.tokens_per_forward:.2f} tokens per target forward "
        f"({stats.new_tokens} tokens, {stats.target_forwards} target forwards)"
    )


class _KVBitsAlias(argparse.Action):
    """--kv-bits B, the older spelling of --kv-format: 16 dense, 8 int8, 4 int4."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, BY_BITS[values].name)


def _add_kv_format_args(parser: argparse.ArgumentParser, what: str) -> None:
    """--kv-format NAME and its older spelling --kv-bits {16,8,4}; both set args.kv_format."""
    parser.add_argument(
        "--kv-format",
        choices=tuple(FORMATS),
        default="dense",
        help=f"{what}: dense keeps the model's dtype, the others store codes with their scales and zero points "
        "(docs/kv-cache.md#the-kv-spec) (default: dense)",
    )
    parser.add_argument(
        "--kv-bits",
        type=int,
        choices=tuple(BY_BITS),
        action=_KVBitsAlias,
        dest="kv_format",
        default=argparse.SUPPRESS,
        help="the older spelling of --kv-format: 16 = dense, 8 = int8, 4 = int4",
    )


def add_kv_args(parser: argparse.ArgumentParser) -> None:
    """--kv-format, --kv-budget, --kv-policy, --kv-sinks (docs/kv-cache.md#kv-settings-and-the-command-line)."""
    _add_kv_format_args(parser, "how full layers store K/V")
    parser.add_argument(
        "--kv-budget",
        type=int,
        default=None,
        metavar="N",
        help="keep at most N tokens per full layer, evicting by --kv-policy; prefill pieces are cut to N "
        "(default: no budget)",
    )
    parser.add_argument(
        "--kv-policy",
        choices=("streaming", "h2o"),
        default="streaming",
        help="eviction under --kv-budget: streaming (sink tokens + most recent) or h2o (heavy hitters + "
        "recent half) (default: streaming)",
    )
    parser.add_argument(
        "--kv-sinks", type=int, default=4, metavar="N", help="streaming: initial tokens always kept (default: 4)"
    )


def kv_settings(args: argparse.Namespace):
    """KVSettings from the --kv-* flags (checked before the model loads); errors name the flag."""
    from gptoss_lite.kv.settings import KVSettings

    if args.kv_budget is not None and getattr(args, "speculate", "none") != "none":
        raise ValueError("--kv-budget cannot be combined with --speculate: an evicting cache cannot roll back")
    if args.kv_budget is None and (args.kv_policy != "streaming" or args.kv_sinks != 4):
        raise ValueError("--kv-policy / --kv-sinks need --kv-budget N")
    try:
        return KVSettings(
            format=args.kv_format, budget=args.kv_budget, policy=args.kv_policy, sink_tokens=args.kv_sinks
        )
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"--kv-format/--kv-budget/--kv-sinks: {exc}") from None


DEFAULT_DECODE_RESERVE = 256  # serve / bench-serve: decode tokens of growth kept free per running request


class _RenamedFlag(argparse.Action):
    """A flag the command no longer takes: giving it is an argparse error that names its replacement
    (hidden from --help; nothing is stored)."""

    def __init__(self, option_strings, dest, *, replacement: str, **kwargs) -> None:
        kwargs.update(nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)
        self.replacement = replacement

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string}: {self.replacement}")


def add_engine_kv_args(parser: argparse.ArgumentParser) -> None:
    """--kv-format and --full-window for the engine (docs/engine.md#kv-format and #full-layer-window)."""
    _add_kv_format_args(parser, "full-layer KV blocks")
    parser.add_argument(
        "--full-window",
        type=int,
        default=None,
        metavar="N",
        help="full layers attend to their last N tokens and release older blocks (a sliding window; the "
        "model's learned sinks stand in for sink tokens); needs --no-prefix-caching (default: every token)",
    )
    parser.add_argument(
        "--kv-budget",
        action=_RenamedFlag,
        dest="renamed_kv_budget",
        replacement="renamed to --full-window N for the engine (full layers attend to their last N tokens); "
        "--kv-budget is the eviction budget of generate, passkey and ruler",
    )
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="decode eagerly; by default all-decode steps run as the compiled decode step, compiled at start "
        "(tens of seconds the first time, seconds from inductor's disk cache)",
    )
    parser.add_argument(
        "--decode-reserve",
        type=int,
        default=DEFAULT_DECODE_RESERVE,
        metavar="N",
        help="admission watermark: a request is admitted only while every running request keeps free blocks "
        "for its next N decode tokens, so long outputs do not outgrow the pool and preempt each other; 0 "
        f"admits on prompts alone (default: {DEFAULT_DECODE_RESERVE})",
    )
    parser.add_argument(
        "--speculate",
        default="none",
        metavar="{none,lookup,draft:PATH}",
        help="speculative decoding in the engine: 'lookup' drafts each decoding request's next tokens by "
        "n-gram lookup in its prompt and output, 'draft:PATH' with a smaller model of the same vocabulary "
        "(a checkpoint directory or preset name, loaded on the same device and dtype); drafts are verified "
        "in the step's one forward, and greedy output is unchanged (default: none)",
    )
    parser.add_argument(
        "--draft-tokens",
        type=int,
        default=None,
        metavar="K",
        help="tokens drafted per request per step (default: 8 for lookup, 4 for a draft model)",
    )


def engine_kv_kwargs(args: argparse.Namespace, *, load_draft: bool = False) -> dict:
    """LLM keyword arguments from --kv-format / --full-window / --no-compile / --speculate / --draft-tokens,
    checked before the model loads. A draft model (--speculate draft:PATH) is loaded only with
    `load_draft` (otherwise `speculate` is left None after its flags are checked)."""
    from gptoss_lite.validation import check_int

    if args.full_window is not None:
        check_int("--full-window", args.full_window, 1)
        if args.kv_format != "dense":
            raise ValueError(f"--full-window {args.full_window} with --kv-format {args.kv_format}: give one of them")
        if not args.no_prefix_caching:
            raise ValueError(
                "--full-window releases prompt blocks the prefix cache would need; add --no-prefix-caching"
            )
    check_speculate_args(args)
    speculate = None
    if args.speculate == "lookup":
        from gptoss_lite.speculative import PromptLookup

        speculate = PromptLookup() if args.draft_tokens is None else PromptLookup(k=args.draft_tokens)
    elif args.speculate != "none" and load_draft:
        from gptoss_lite.checkpoint import load_model
        from gptoss_lite.speculative import DraftModel

        device = resolve_device(args.device)
        draft = load_model(args.speculate[len("draft:") :], device=device, dtype=torch_dtype(args.dtype))
        speculate = DraftModel(draft) if args.draft_tokens is None else DraftModel(draft, k=args.draft_tokens)
    return {
        "kv_format": args.kv_format,
        "full_window": args.full_window,
        "compile_decode": not args.no_compile,
        "decode_reserve": check_int("--decode-reserve", args.decode_reserve, 0),
        "speculate": speculate,
    }
