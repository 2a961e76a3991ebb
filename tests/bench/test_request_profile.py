"""`bench profile`: every stage of every shape timed through the gateway's own code, and the table,
JSON and PNG that come out."""

from __future__ import annotations

import json
from pathlib import Path

from bench.request_profile import STAGES, shapes
from prefixgate.cli import main


def test_every_stage_of_every_shape_is_timed(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    main(["bench", "profile", "--requests", "3", "--json", str(out)])
    payload = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    results = payload["stages_s"]
    assert sorted(results) == sorted(shape.name for shape in shapes())
    for name, stages in results.items():
        assert set(stages) == set(STAGES)
        # Every request is parsed, read, hashed, matched, decided, recorded, given its headers both
        # ways, accounted for and released.
        timed = ("parse", "view", "tokenize", "hash", "match", "record", "headers", "accounting", "release")
        for stage in timed:
            assert stages[stage] > 0, (name, stage)
        # Only chats go through the template, and only where the gateway tokenizes them.
        rendered = name.startswith(("chat", "conversation")) and not name.endswith("routed on text")
        assert (stages["of which render"] > 0) is rendered
