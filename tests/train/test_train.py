"""Trainer: config loading and validation, synthetic data, one step, resume, DDP, CLI (docs/training.md)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import socket
from pathlib import Path

import pytest
import torch

from gptoss_lite.config import count_parameters
from gptoss_lite.evals.passkey import FILLER_SENTENCES
from gptoss_lite.filler import varied_sentence
from gptoss_lite.prompts import NEEDLE_TEMPLATE, QUESTION
from gptoss_lite.tokenizer import ByteTokenizer
from gptoss_lite.train.config import DataConfig, ScheduleConfig, TrainConfig, load_train_config
from gptoss_lite.train.data import IGNORE_INDEX, SyntheticRetrievalData

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN = 224  # shortest comfortable length for the byte-level documents


def tiny_config(out_dir: Path, **overrides) -> TrainConfig:
    """A lite-tiny model on short sequences: a step takes well under a second on CPU."""
    data = {
        "model": {"preset": "lite-tiny", "n_layers": 2},
        "data": {"seq_len": SEQ_LEN, "batch_size": 2, "seed": 7},
        "optimizer": {"lr": 3e-3},
        "schedule": {"warmup_steps": 1, "total_steps": 4},
        "checkpoint": {"out_dir": str(out_dir), "every_n_steps": 2, "keep": 2},
        "logging": {"every_n_steps": 1},
        "device": "cpu",
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return TrainConfig.from_dict(data)


# ---- config -----------------------------------------------------------------------------------------


def test_demo_config_loads():
    """configs/demo_cpu.yaml is a valid TrainConfig that records its seq_len as train_context_length."""
    cfg = load_train_config(REPO / "configs" / "demo_cpu.yaml")
    assert cfg.data.seq_len == 256 and cfg.model.train_context_length == 256
    assert cfg.model.vocab_size == 264 and cfg.model.d_model == 128
    SyntheticRetrievalData(cfg.data)  # the documents fit the sequence length


def test_a100_config_is_the_502m_preset_at_4096():
    """configs/pretrain_a100_502m.yaml: the 502M preset at 4,096 tokens, bf16, checkpointing."""
    cfg = load_train_config(REPO / "configs" / "pretrain_a100_502m.yaml")
    assert cfg.model_preset == "gptoss-lite-502m"
    assert count_parameters(cfg.model) == 501_836_640
    assert cfg.data.seq_len == 4096 and cfg.model.train_context_length == 4096
    assert cfg.precision == "bf16" and cfg.gradient_checkpointing
    SyntheticRetrievalData(cfg.data)


def test_config_round_trips_through_dict(tmp_path):
    """to_dict -> JSON -> load_train_config gives an equal config."""
    cfg = tiny_config(tmp_path)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert load_train_config(path) == cfg


def test_missing_config_file_is_a_clear_error(tmp_path):
    """A nonexistent config path raises FileNotFoundError naming the path."""
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_train_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "data, match",
    [
        ({"optimiser": {}}, r"unknown train config key\(s\) \['optimiser'\]"),
        ({"data": {"seqlen": 8}}, r"unknown key\(s\) \['seqlen'\] in section 'data'"),
        ({"model": {"preset": "lite-tiny", "dmodel": 8}}, r"unknown model field\(s\) \['dmodel'\]"),
        ({"model": {"dmodel": 8}}, r"unknown ModelConfig field\(s\) \['dmodel'\]"),
        ({"model": {"preset": "nope"}}, "unknown preset 'nope'"),
        ({"precision": "fp16"}, "precision='fp16': must be one of"),
        ({"schedule": {"warmup_steps": 10, "total_steps": 5}}, "warmup_steps=10: must be <= total_steps=5"),
        ({"data": {"loss_on": "prompt"}}, "loss_on='prompt'"),
        ({"data": {"filler": "lorem"}}, r"data.filler='lorem': must be one of \('procedural', 'varied'\)"),
    ],
)
def test_bad_config_keys_and_values_are_rejected(tmp_path, data, match):
    """Unknown keys are named at every level; bad values say the limit."""
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_dict({"model": {"preset": "lite-tiny"}, **data})


def test_unknown_key_in_yaml_file_names_the_file(tmp_path):
    """Errors from a config file name the file and the bad key."""
    path = tmp_path / "bad.yaml"
    path.write_text("model: {preset: lite-tiny}\ndata: {seq_len: 256, batchsize: 4}\n")
    with pytest.raises(ValueError, match=r"bad.yaml: unknown key\(s\) \['batchsize'\]"):
        load_train_config(path)


def test_seq_len_too_short_for_documents():
    """A seq_len that cannot hold the document overhead is rejected with the minimum."""
    with pytest.raises(ValueError, match=r"data.seq_len=64: too short .* use seq_len >= \d+"):
        SyntheticRetrievalData(DataConfig(seq_len=64))


def test_lr_schedule_warmup_then_cosine():
    """lr factor rises linearly to 1 over warmup and decays by cosine to min_lr_ratio."""
    s = ScheduleConfig(warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [s.lr_factor(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.lr_factor(4) == pytest.approx(1.0)
    assert s.lr_factor(9) == pytest.approx(0.55)
    assert s.lr_factor(14) == pytest.approx(0.1)
    factors = [s.lr_factor(i) for i in range(4, 15)]
    assert all(a >= b for a, b in zip(factors, factors[1:]))


# ---- data -------------------------------------------------------------------------------------------


def test_batches_are_deterministic_per_step_and_shifted():
    """batch(k) depends only on (seed, k); targets are inputs shifted by one; every row is seq_len."""
    cfg = DataConfig(seq_len=SEQ_LEN, batch_size=4, seed=3)
    a, b = SyntheticRetrievalData(cfg), SyntheticRetrievalData(cfg)
    x0, y0 = a.batch(0)
    a.batch(5)
    x0b, y0b = b.batch(0)
    assert x0.shape == y0.shape == (4, SEQ_LEN) and x0.dtype == torch.long
    assert torch.equal(x0, x0b) and torch.equal(y0, y0b)
    assert torch.equal(x0[:, 1:], y0[:, :-1])
    assert not torch.equal(a.batch(1)[0], x0)
    other_seed = SyntheticRetrievalData(DataConfig(seq_len=SEQ_LEN, batch_size=4, seed=4))
    assert not torch.equal(other_seed.batch(0)[0], x0)


def test_ranks_and_micro_steps_draw_different_rows():
    """DDP ranks and accumulation micro-steps get disjoint rows of the same step."""
    cfg = DataConfig(seq_len=SEQ_LEN, batch_size=2, seed=3)
    rows = [
        SyntheticRetrievalData(cfg, rank=r, world_size=2, grad_accum_steps=2).batch(9, m)[0]
        for r in range(2)
        for m in range(2)
    ]
    flat = {tuple(row.tolist()) for batch in rows for row in batch}
    assert len(flat) == 8


def test_documents_end_with_question_and_answer():
    """Passkey documents hold the needle once and end with the question and its answer digits."""
    data = SyntheticRetrievalData(
        DataConfig(
            seq_len=512,
            batch_size=16,
            seed=0,
            passkey_weight=1.0,
            kv_weight=0.0,
            copy_weight=0.0,
            eval_phrasing_prob=1.0,
        )
    )
    x, y = data.batch(0)
    tok = ByteTokenizer()
    for i in range(16):
        text = tok.decode(torch.cat([x[i], y[i, -1:]]).tolist())
        key = text.rsplit(" ", 1)[-1].rstrip(".")
        assert len(key) == 5 and key.isdigit()
        assert text.endswith(QUESTION + f" {key}.")
        assert text[: text.rindex(QUESTION)].count(NEEDLE_TEMPLATE.format(key=key)) == 1
        assert x[i, 0].item() == tok.bos_id and y[i, -1].item() == tok.eos_id


@pytest.mark.parametrize("filler", ["procedural", "varied"])
def test_training_filler_is_not_the_evaluator_filler(filler):
    """No sentence of the evaluator's filler bank appears in training documents of either filler."""
    data = SyntheticRetrievalData(DataConfig(seq_len=1024, batch_size=8, seed=0, filler=filler))
    x, _ = data.batch(0)
    text = "".join(ByteTokenizer().decode(row.tolist()) for row in x)
    assert not [s for s in FILLER_SENTENCES if s.strip() in text]


def test_varied_filler_is_digit_free_and_varied():
    """The varied haystack has no digits (needles are the only numbers), many distinct sentence
    shapes and lengths, short fragments like the evaluator's, and never an evaluator sentence."""
    rng = random.Random(0)
    sentences = [varied_sentence(rng) for _ in range(5000)]
    assert not any(ch.isdigit() for s in sentences for ch in s)
    assert all(s[0] in " \n" and s[-1] in ".!;" for s in sentences)
    assert len(set(sentences)) > 4900
    words = [len(s.split()) for s in sentences]
    assert min(words) == 1 and max(words) >= 20
    assert not set(FILLER_SENTENCES) & set(sentences)


@pytest.mark.parametrize(
    "config, last_step, expected",
    [
        ("demo_cpu.yaml", 2999, "f93c6c21ec96d71cc6283af8980efea6b388a2a7b08c50f58d5a7b1d9ae08e14"),
        ("demo_cpu_stage2.yaml", 1999, "d549e710342a11ded2d4f616f5f39a474823a0ff51901e92973c607e1dd0beb5"),
        ("demo_cpu_stage3.yaml", 2999, "6c3b037850cfb165f69ffc5efbca1fe2342d7db667388adccf6788267605740f"),
        ("demo_cpu_stage4.yaml", 2699, "f2e02caab38e656c189df8ea816a3d5daf268ee46c1e7fe04002e28487d9c6c4"),
        ("long4k_stage1.yaml", 599, "e6805d41108e8960740381eada98f10395c3b90feb4f900f336ecc671e2b978f"),
        ("long4k_stage2.yaml", 699, "22ec2a0c6ab13ee8599b16f41afac4ba64e58360bc83bb1d1278b24a3b9b60f3"),
        ("long4k_stage3p.yaml", 1199, "8ffec3049eb8c0bb391cf9b308b9d06ff6bb8b00bcc11834289d897a09053cfa"),
        ("long4k_stage3a.yaml", 299, "3f337113c179bee2e491c57ff3b05db3d294591a89d9f29f318e3eb4796074e0"),
    ],
)
def test_demo_recipe_data_streams_are_pinned(config, last_step, expected):
    """Every stage of the committed models' recipes must keep drawing the documents they were trained
    on (the byte-identical re-run in docs/training.md#the-256-token-model-modelslite-256 depends on it): digests
    of three batches are pinned. A deliberate data change must update these and retrain the committed
    model."""
    data = SyntheticRetrievalData(load_train_config(REPO / "configs" / config).data)
    digest = hashlib.sha256()
    for step in (0, 1, last_step):
        x, y = data.batch(step)
        digest.update(x.numpy().tobytes())
        digest.update(y.numpy().tobytes())
    assert digest.hexdigest() == expected


def test_answer_only_loss_masks_everything_but_the_answer():
    """loss_on='answer' leaves only the answer tokens (and EOS) as targets."""
    data = SyntheticRetrievalData(DataConfig(seq_len=SEQ_LEN, batch_size=3, seed=0, loss_on="answer"))
    _, y = data.batch(0)
    for row in y:
        kept = (row != IGNORE_INDEX).nonzero().flatten()
        assert 3 <= len(kept) <= 60
        assert kept[-1].item() == SEQ_LEN - 1 and torch.equal(kept, torch.arange(kept[0].item(), SEQ_LEN))


# ---- training -----------------------------------------------------------------------------------------


def test_one_training_step_lowers_the_loss():
    """One AdamW step on a batch lowers the LM loss on that batch."""
    from gptoss_lite.model import GPTOSS
    from gptoss_lite.train.loop import _build_optimizer

    cfg = tiny_config(Path("unused"))
    torch.manual_seed(0)
    model = GPTOSS(cfg.model).train()
    optimizer = _build_optimizer(model, cfg)
    x, y = SyntheticRetrievalData(cfg.data).batch(0)
    out = model(x, targets=y)
    (out.loss + cfg.aux_loss_coef * out.aux_loss).backward()
    optimizer.step()
    with torch.no_grad():
        after = model(x, targets=y).loss.item()
    assert out.aux_loss.ndim == 0
    assert after < out.loss.item() - 0.05


def test_train_writes_final_model_metrics_and_checkpoints(tmp_path):
    """train() saves final/ (with train_context_length), metrics.jsonl and the last `keep` checkpoints."""
    from gptoss_lite.checkpoint import load_model
    from gptoss_lite.train.loop import latest_checkpoint

    summary = train_run(tiny_config(tmp_path), max_steps=4)
    assert summary.end_step == 4 and len(summary.losses) == 4
    assert all(math.isfinite(v) for v in summary.losses + summary.aux_losses)
    assert summary.tokens_per_s > 0
    final = load_model(tmp_path / "final")
    assert final.config.train_context_length == SEQ_LEN
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [1, 2, 3, 4]
    assert {"loss", "aux_loss", "lr", "tokens_per_s", "grad_norm"} <= set(lines[0])
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0000002", "step_0000004"]
    assert latest_checkpoint(tmp_path).name == "step_0000004"
    assert not list(tmp_path.rglob("*.pt")) and not list(tmp_path.rglob("*.pkl"))


def test_resume_continues_from_the_saved_step_with_the_same_loss(tmp_path):
    """Stopping at step 2 and resuming reproduces the uninterrupted run's losses of steps 3-4."""
    full = train_run(tiny_config(tmp_path / "full"), max_steps=4)
    cfg = tiny_config(tmp_path / "split")
    first = train_run(cfg, max_steps=2)
    resumed = train_run(cfg, resume=True)
    assert first.losses == pytest.approx(full.losses[:2], abs=0)
    assert resumed.start_step == 2 and resumed.end_step == 4
    assert resumed.losses == pytest.approx(full.losses[2:], rel=1e-6)


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    """--resume with an empty output directory says to run without --resume first."""
    with pytest.raises(FileNotFoundError, match="no checkpoint under .* run once without --resume"):
        train_run(tiny_config(tmp_path), resume=True)


def test_bf16_autocast_step_runs(tmp_path):
    """precision bf16 trains with autocast and finite losses."""
    try:
        summary = train_run(tiny_config(tmp_path, precision="bf16"), max_steps=1)
    except RuntimeError as e:
        # torch's limit, not ours: on an AMX Xeon with ATEN_CPU_CAPABILITY=avx2 (the tests' AVX2 probe),
        # ATen's bf16 GEMM still takes its AMX route and refuses to pack for it ("pack_vnni2 is only
        # supported when avx512 is supported"). A real AVX2 CPU has no AMX route, so it never gets here.
        if "pack_vnni2" in str(e) and os.environ.get("ATEN_CPU_CAPABILITY"):
            pytest.skip(f"torch cannot run bf16 autocast under ATEN_CPU_CAPABILITY on this CPU: {e}")
        raise
    assert summary.end_step == 1 and math.isfinite(summary.losses[0])


def train_run(cfg, **kwargs):
    from gptoss_lite.train.loop import train

    return train(cfg, progress=False, **kwargs)


# ---- DDP ----------------------------------------------------------------------------------------------


def _ddp_worker(rank: int, world: int, port: int, out_dir: str, result_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    summary = train_run(tiny_config(Path(out_dir)), max_steps=2)
    # The gloo threads still alive once train() has returned (Linux names them in /proc).
    tasks = Path("/proc/self/task")
    threads = [(t / "comm").read_text().strip() for t in tasks.iterdir()] if tasks.is_dir() else []
    Path(result_dir, f"rank{rank}.json").write_text(
        json.dumps(
            {"losses": summary.losses, "final": summary.final_dir, "gloo_threads": [n for n in threads if "gloo" in n]}
        )
    )


def test_ddp_two_processes_train(tmp_path):
    """Two gloo processes train 2 steps: identical (all-reduced) losses, only rank 0 writes, the result
    equals one process accumulating both ranks' rows, and no gloo thread outlives train()."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(2, port, str(tmp_path / "run"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert len(r0["losses"]) == 2 and r0["losses"] == r1["losses"]
    assert r0["final"] is not None and r1["final"] is None
    # train() destroys the group it created, threads included: nothing is left to tear down at exit.
    assert r0["gloo_threads"] == [] and r1["gloo_threads"] == []
    # Rank r draws rows r·B … of a step, exactly the rows of micro-batch r of one process with
    # grad_accum_steps=2: averaged gradients must give that process's losses and weights.
    from safetensors.torch import load_file

    single = train_run(tiny_config(tmp_path / "single", optimizer={"grad_accum_steps": 2}), max_steps=2)
    assert single.losses == pytest.approx(r0["losses"], rel=1e-5)
    # AdamW is nearly blind to a gradient's scale, so check the averaged gradients' norm itself.
    norms = [
        [json.loads(line)["grad_norm"] for line in (d / "metrics.jsonl").read_text().splitlines()]
        for d in (tmp_path / "run", tmp_path / "single")
    ]
    assert norms[0] == pytest.approx(norms[1], rel=1e-4)
    got, want = (load_file(str(d / "final" / "model.safetensors")) for d in (tmp_path / "run", tmp_path / "single"))
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


# ---- CLI ----------------------------------------------------------------------------------------------


def test_cli_train_smoke(tmp_path, capsys):
    """`gptoss-lite train --config ... --max-steps 1 --out DIR` trains and reports tokens/s."""
    from gptoss_lite.cli import main

    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(tiny_config(tmp_path / "ignored").to_dict()))
    assert (
        main(["train", "--config", str(path), "--max-steps", "1", "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    )
    assert "tokens/s" in capsys.readouterr().out
    assert (tmp_path / "out" / "final" / "config.json").is_file()
    assert not (tmp_path / "ignored").exists()


def test_cli_train_missing_config_exits_2(tmp_path, capsys):
    """A nonexistent --config is exit code 2 with a one-line error."""
    from gptoss_lite.cli import main

    assert main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_init_from_starts_a_second_stage_from_saved_weights(tmp_path):
    """init_from loads a saved model before step 1: the stage-2 first loss equals stage 1's final model's loss."""
    from gptoss_lite.checkpoint import load_model
    from gptoss_lite.train.data import SyntheticRetrievalData

    first = tiny_config(tmp_path / "one")
    train_run(first, max_steps=4)
    second = tiny_config(tmp_path / "two", init_from=str(tmp_path / "one" / "final"))
    summary = train_run(second, max_steps=1)
    model = load_model(tmp_path / "one" / "final").train()
    x, y = SyntheticRetrievalData(second.data).batch(0)
    with torch.no_grad():
        expected = model(x, targets=y).loss.item()
    assert summary.losses[0] == pytest.approx(expected, rel=1e-5)


def test_init_rope_change_moves_a_checkpoint_to_a_longer_context(tmp_path):
    """A checkpoint with other rope settings is refused by name, unless init_rope_change says the move is
    deliberate; then its weights load unchanged under the new positions. Other fields stay strict."""
    from gptoss_lite.checkpoint import load_model

    first = tiny_config(tmp_path / "one")
    train_run(first, max_steps=2)
    longer = {"rope_original_context": 4 * SEQ_LEN, "max_position_embeddings": 64 * SEQ_LEN}
    moved = tiny_config(tmp_path / "two", model=longer, init_from=str(tmp_path / "one" / "final"))
    with pytest.raises(ValueError, match="rope_original_context"):
        train_run(moved, max_steps=1)
    assert not (tmp_path / "two" / "final").exists()
    start = str(tmp_path / "one" / "final")
    moved = tiny_config(tmp_path / "two", model=longer, init_from=start, init_rope_change=True)
    train_run(moved, max_steps=1)
    old, new = load_model(tmp_path / "one" / "final"), load_model(tmp_path / "two" / "final")
    assert new.config.rope_original_context == 4 * SEQ_LEN and old.config.rope_original_context != 4 * SEQ_LEN
    wider = {**longer, "d_model": 2 * first.model.d_model}
    wider = tiny_config(tmp_path / "three", model=wider, init_from=start, init_rope_change=True)
    with pytest.raises(ValueError, match="d_model"):
        train_run(wider, max_steps=1)
    with pytest.raises(ValueError, match="needs init_from"):
        tiny_config(tmp_path / "four", init_rope_change=True)


def test_a_later_stage_may_train_at_another_length(tmp_path):
    """A length curriculum: init_from a checkpoint trained at SEQ_LEN, then train at 2 * SEQ_LEN. The
    recorded train_context_length is the only field that differs, and it may (no init_rope_change)."""
    from gptoss_lite.checkpoint import load_model

    train_run(tiny_config(tmp_path / "one"), max_steps=1)
    longer = tiny_config(tmp_path / "two", data={"seq_len": 2 * SEQ_LEN}, init_from=str(tmp_path / "one" / "final"))
    train_run(longer, max_steps=1)
    assert load_model(tmp_path / "two" / "final").config.train_context_length == 2 * SEQ_LEN


def test_init_from_missing_directory_is_an_error(tmp_path):
    """A missing init_from directory fails before training, naming the path."""
    cfg = tiny_config(tmp_path, init_from=str(tmp_path / "nope"))
    with pytest.raises((FileNotFoundError, ValueError), match="nope"):
        train_run(cfg, max_steps=1)
