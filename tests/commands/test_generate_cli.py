import io
import json

import pytest

from gptoss_lite.cli import main


def test_generate_prints_text_and_stats(capsys):
    """`gptoss-lite generate` prints text; --stats gives speed and KV bytes (the last token is never cached)."""
    assert (
        main(["generate", "Hello", "--model", "lite-tiny", "--max-new-tokens", "8", "--temperature", "0", "--stats"])
        == 0
    )
    out, err = capsys.readouterr()
    assert out.endswith("\n")
    assert "prefill: 6 tokens" in err  # BOS and the 5 bytes of "Hello" and "tokens/s" in err
    assert "KV cache:" in err and "all-global cache of 13 tokens" in err


def test_generate_json_is_reproducible(capsys):
    """--json gives text and figures; a seed makes sampled text reproducible."""
    args = [
        "generate",
        "abc",
        "--model",
        "lite-tiny",
        "--max-new-tokens",
        "12",
        "--temperature",
        "1.0",
        "--seed",
        "3",
        "--json",
        "--no-stop",
    ]
    texts = []
    for _ in range(2):
        assert main(args) == 0
        data = json.loads(capsys.readouterr().out)
        texts.append(data["text"])
        assert data["prompt_tokens"] == 4 and data["new_tokens"] == 12  # BOS, "abc"
        assert data["kv_payload_bytes"] <= data["kv_all_global_payload_bytes"]
    assert texts[0] == texts[1]


def test_generate_reads_stdin(monkeypatch, capsys):
    """With no prompt argument the prompt comes from standard input."""
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin"))
    assert main(["generate", "--model", "lite-tiny", "--max-new-tokens", "2", "--temperature", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_token_ids"] == [256, *b"from stdin"]


@pytest.mark.parametrize(
    "argv,match",
    [
        (["generate", "", "--model", "lite-tiny"], "empty prompt"),
        (["generate", "x", "--model", "lite-tiny", "--top-p", "0"], "top_p"),
        (["generate", "x", "--model", "lite-tiny", "--max-new-tokens", "-1"], "--max-new-tokens=-1: must be >= 0"),
        (["generate", "x", "--model", "no-such-preset"], "unknown preset|not a directory|no-such-preset"),
        (
            ["generate", "x", "--model", "lite-tiny", "--compile", "--kv-format", "int8"],
            "--compile runs decode on the 16-bit",
        ),
        (["generate", "x", "--model", "lite-tiny", "--compile", "--speculate", "lookup"], "--speculate lookup cannot"),
    ],
)
def test_generate_bad_input_exit_2(argv, match, capsys):
    """Bad CLI input exits 2 with one clear error line, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and pytest.importorskip("re").search(match, err)


def test_generate_compile_gives_the_same_text_and_reports_the_compile(capsys):
    """--compile decodes through the compiled graph: same greedy text, the first step's time reported."""
    base = ["generate", "Hello", "--model", "lite-tiny", "--max-new-tokens", "10", "--temperature", "0", "--json"]
    assert main(base) == 0
    eager = json.loads(capsys.readouterr().out)
    assert main([*base, "--compile"]) == 0
    compiled = json.loads(capsys.readouterr().out)
    assert compiled["text"] == eager["text"] and eager["decode_compile_s"] is None
    assert compiled["decode_compile_s"] > 0 and compiled["kv_payload_bytes"] == eager["kv_payload_bytes"]


def test_stream_printer_never_splits_a_multibyte_character():
    """Streaming 'é€😀' byte by byte prints exactly the text, with no U+FFFD and nothing dropped."""
    from gptoss_lite.commands.generate import StreamPrinter
    from gptoss_lite.tokenizer import EOS_ID, ByteTokenizer

    out = io.StringIO()
    printer = StreamPrinter(ByteTokenizer(), stops=[EOS_ID], out=out)
    for b in "aé€😀b".encode():
        printer.push(b)
        assert "\ufffd" not in out.getvalue()
    printer.push(EOS_ID)
    printer.finish()
    assert out.getvalue() == "aé€😀b"


def test_stream_printer_ends_an_invalid_tail_like_the_plain_text():
    """A truncated multi-byte sequence at the end prints as U+FFFD, exactly as without --stream."""
    from gptoss_lite.commands.generate import StreamPrinter
    from gptoss_lite.tokenizer import ByteTokenizer

    out = io.StringIO()
    printer = StreamPrinter(ByteTokenizer(), stops=[], out=out)
    ids = list("x€".encode())[:-1]
    for b in ids:
        printer.push(b)
    printer.finish()
    assert out.getvalue() == ByteTokenizer().decode(ids) == "x\ufffd"


def test_generate_stream_prints_the_same_text_as_without_stream(monkeypatch, capsys):
    """`generate --stream` prints the same characters as plain `generate` when tokens split a character."""
    import torch

    import gptoss_lite.generation as generation

    text = "né€😀"

    def fake_stream_generate(model, input_ids, *args, **kwargs):
        return iter(torch.tensor([b]) for b in text.encode("utf-8"))

    monkeypatch.setattr(generation, "stream_generate", fake_stream_generate)
    outs = []
    for extra in ([], ["--stream"]):
        assert main(["generate", "hi", "--model", "lite-tiny", "--max-new-tokens", "9", *extra]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] == text + "\n"
