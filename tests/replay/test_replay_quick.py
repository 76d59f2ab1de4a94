"""``rayturn replay --quick`` in a fresh clone: no recorded traces anywhere, so it replays sample ones it writes.

One embedded cluster (the replay's own Ray), about a minute on two cores. Everything it makes lands under
``--out``: the sample traces it replayed, the JSON, the Markdown report and the plots; its last line of stdout
is the JSON headline, which says the traces were samples.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rayturn.cli import main
from rayturn.replay import cli as replay

HTTP_PORT, GRPC_PORT = 28571, 29571


def test_quick_replay_without_traces_runs_on_sample_traces_and_writes_under_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(replay, "DEFAULT_TRACES", tmp_path / "shared" / "traces" / "weka")  # a clone alone
    out = tmp_path / "out"
    arguments = ["replay", "--quick", "--out", str(out), "--http-port", str(HTTP_PORT), "--grpc-port", str(GRPC_PORT)]
    assert main(arguments) == 0
    captured = capsys.readouterr()
    assert "generated sample conversations" in captured.err
    headline = json.loads(captured.out.strip().splitlines()[-1])
    assert headline["bench"] == "replay" and headline["sample_traces"] is True
    assert headline["calls"] > 0 and headline["failures"] == 0 and headline["conversations"] == 4
    assert headline["results_file"] == str(out / "replay.json")
    assert headline["markdown_file"] == str(out / "replay.md")
    assert all(Path(plot).parent == out and Path(plot).is_file() for plot in headline["plot_files"])
    assert sorted(path.name for path in (out / "sample_traces").iterdir()) == [
        f"sample_{index:04d}.json" for index in range(1, 7)
    ]
    results = json.loads((out / "replay.json").read_text())
    assert results["traces"] == [str(out / "sample_traces")] and results["sample_traces"] is True
