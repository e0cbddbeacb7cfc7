"""`dflash generate` end to end on tiny model directories."""

import json
import subprocess
import sys

import pytest
from dflash.cli import main
from dflash.drafter.checkpoint import save_drafter
from tiny import char_tokenizer, tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = tiny_target("qwen3")
    target.save_pretrained(root / "target")
    char_tokenizer().save_pretrained(root / "target")
    save_drafter(tiny_drafter(target, block_size=8), root / "drafter")
    return root / "target", root / "drafter"


def run_json(capsys, *args) -> dict:
    assert main(["generate", *map(str, args), "--json", "--device", "cpu"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_output_equals_target_alone(dirs, capsys):
    target, drafter = dirs
    common = ["def f(x):", "--target", target, "--max-new-tokens", 30, "--ignore-eos"]
    spec = run_json(capsys, *common, "--drafter", drafter)
    alone = run_json(capsys, *common, "--drafter", drafter, "--block-size", 1)
    assert spec["token_ids"] == alone["token_ids"] and len(spec["token_ids"]) == 30
    assert spec["text"] == char_tokenizer().decode(spec["token_ids"])
    assert set(spec["stats"]) >= {"tau", "acceptance_histogram", "decode_tokens_per_s", "ttft_s", "rounds"}
    assert alone["stats"]["tau"] == 1.0


def test_sampling_flags_and_stop(dirs, capsys):
    target, drafter = dirs
    common = ["abc", "--target", target, "--drafter", drafter, "--max-new-tokens", 40, "--ignore-eos",
              "--temperature", 0.9, "--top-p", 0.9, "--top-k", 20, "--seed", 7]
    a = run_json(capsys, *common)
    b = run_json(capsys, *common, "--block-size", 1)
    assert a["token_ids"] == b["token_ids"]
    stop = a["text"][5:7]
    c = run_json(capsys, *common, "--stop", stop)
    assert c["text"] == a["text"][: a["text"].index(stop)] and c["finish_reason"] == "stop"


def test_streams_text_then_statistics(dirs, capsys):
    target, drafter = dirs
    assert main(["generate", "x = ", "--target", str(target), "--drafter", str(drafter), "--max-new-tokens", "12",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr()
    assert "tau=" in out.err and "tok/s" in out.err
    assert len(out.out.strip("\n")) > 0


def test_errors_are_one_line_without_traceback(dirs, tmp_path):
    target, drafter = dirs
    proc = subprocess.run(
        [sys.executable, "-m", "dflash.cli", "generate", "hi", "--target", str(target), "--drafter", str(drafter),
         "--top-p", "2", "--device", "cpu"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "top_p: must be in (0, 1]" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "dflash.cli", "generate", "hi", "--target", str(tmp_path / "missing"),
         "--device", "cpu"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
