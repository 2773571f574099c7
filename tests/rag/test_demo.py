"""`pcr-rag demo` end to end on a tiny random model saved as an HF directory, a small text corpus and 4 questions."""

from __future__ import annotations

import json

import pytest

from pcr_rag.rag import demo
from pcr_rag.testing import save_tiny_model

CORPUS = {
    "heapq.txt": "heapq implements a binary min-heap on a plain list.\n\nheappush adds an item; heappop removes the "
                 "smallest item and returns it.",
    "bisect.txt": "bisect keeps a sorted list sorted.\n\nbisect_left returns the insertion point for a value and "
                  "insort inserts it in order.",
    "json.txt": "json encodes Python objects as JSON text.\n\njson.dumps returns a str and json.loads parses one.",
}
QUESTIONS = ["How does heappop work?", "How does bisect find an insertion point?",
             "What does heappush do?", "How does insort keep a list sorted?"]


@pytest.fixture
def demo_args(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, text in CORPUS.items():
        (corpus / name).write_text(text, encoding="utf-8")
    questions = tmp_path / "questions.txt"
    questions.write_text("# one per line\n" + "\n".join(QUESTIONS) + "\n", encoding="utf-8")
    model_dir = save_tiny_model(tmp_path / "tiny-llama")
    return ["--model", str(model_dir), "--corpus", str(corpus), "--questions", str(questions),
            "--index-dir", "", "--top-k", "2", "--max-new-tokens", "3", "--chunk-size", "16",
            "--dram", "16MiB", "--json", str(tmp_path / "demo.json")]


def test_demo_runs_cache_on_and_off_and_compares(demo_args, tmp_path, capsys) -> None:
    assert demo.main(demo_args) == 0
    out = capsys.readouterr().out
    assert "[5/5] the same 4 questions, cache OFF" in out
    assert "answers identical: 4/4" in out
    assert out.count("TTFT") >= 8 and "computed" in out
    result = json.loads((tmp_path / "demo.json").read_text())
    on, off = result["summary"]["cache on"], result["summary"]["cache off"]
    assert on["prompt_tokens"] == off["prompt_tokens"] > 0
    assert off["computed_tokens"] == off["prompt_tokens"]
    assert on["computed_tokens"] < off["computed_tokens"]  # the second question of each pair reused KV
    assert on["from_dram"] + on["from_ssd"] == on["prompt_tokens"] - on["computed_tokens"]
    assert all(a["sources"] for a in result["runs"][0]["answers"])


def test_demo_rejects_an_empty_questions_file(demo_args, tmp_path) -> None:
    empty = tmp_path / "none.txt"
    empty.write_text("# nothing\n\n", encoding="utf-8")
    args = list(demo_args)
    args[args.index("--questions") + 1] = str(empty)
    with pytest.raises(SystemExit, match="no questions"):
        demo.main(args)
