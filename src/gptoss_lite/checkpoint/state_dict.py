"""The strict check every checkpoint load runs: exact tensor names and shapes, floating and finite.

Shared by the native and the Hugging Face readers (`native.py`, `hf.py`), which is why it lives in
neither: each imports it from here, and neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch


def check_state_dict(
    expected: Mapping[str, tuple[int, ...]],
    state: Mapping[str, torch.Tensor],
    source: str,
    codes: Collection[str] = (),
) -> None:
    """Raise ValueError unless `state` has exactly the expected names and shapes, all finite.

    `codes` names the tensors that hold packed uint8 codes (MXFP4 blocks and scales) rather than
    floating-point values. Every problem is listed (missing, unexpected, mis-shaped with both shapes,
    wrong dtype, non-finite), so one error message shows everything that is wrong with a checkpoint.
    """
    problems = []
    for name in sorted(set(expected) - set(state)):
        problems.append(f"missing tensor {name} (expected shape {list(expected[name])})")
    for name in sorted(set(state) - set(expected)):
        problems.append(f"unexpected tensor {name} (shape {list(state[name].shape)})")
    for name in sorted(set(expected) & set(state)):
        got = tuple(state[name].shape)
        if got != tuple(expected[name]):
            problems.append(f"tensor {name}: shape {list(got)} in checkpoint, model expects {list(expected[name])}")
        elif name in codes:
            if state[name].dtype != torch.uint8:
                problems.append(f"tensor {name}: dtype {state[name].dtype}, expected uint8 MXFP4 codes")
        elif not state[name].is_floating_point():
            problems.append(f"tensor {name}: dtype {state[name].dtype} is not floating point")
        elif not bool(torch.isfinite(state[name]).all()):
            n_bad = int((~torch.isfinite(state[name])).sum())
            problems.append(f"tensor {name}: {n_bad} non-finite value(s) (nan/inf)")
    if len(problems) == 1:  # one problem, one line
        raise ValueError(f"{source}: checkpoint does not match the model config: {problems[0]}")
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise ValueError(f"{source}: checkpoint does not match the model config:\n  " + "\n  ".join(shown))
