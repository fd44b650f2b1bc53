"""The quick-start conversion is exactly seed 003's four steps: every change sits in a marked step."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "quick_start"


def changed_blocks(old: list[str], new: list[str]) -> list[tuple[int, list[str]]]:
    """Group the diff's changed lines by the '# Step N' marker that opens their block.

    A block ends at the first unchanged non-blank line; a change outside any block is step 0.
    """
    blocks: list[tuple[int, list[str]]] = []
    current = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes():
        if op == "equal":
            if any(line.strip() for line in new[j1:j2]):
                current = 0
            continue
        added = [x for x in new[j1:j2] if x.strip()]
        first = re.match(r"# Step (\d):", added[0]) if added else None
        if first:  # a block opens here: what this change removes belongs to it
            current = int(first.group(1))
            blocks.append((current, []))
            added = added[1:]
        for line in [*("-" + x for x in old[i1:i2] if x.strip()), *("+" + x for x in added)]:
            m = re.match(r"\+# Step (\d):", line)
            if m:
                current = int(m.group(1))
                blocks.append((current, []))
            elif current == 0:
                blocks.append((0, [line]))
            else:
                blocks[-1][1].append(line)
    return blocks


def test_diff_is_the_four_steps_and_nothing_else():
    old = (EXAMPLES / "train.py").read_text().splitlines()
    new = (EXAMPLES / "train_fleet.py").read_text().splitlines()
    blocks = changed_blocks(old, new)
    assert [step for step, _ in blocks] == [1, 2, 3, 4], blocks
    joined = {step: "\n".join(lines) for step, lines in blocks}
    assert "from fleetlike import" in joined[1]
    assert "fleet.init(role)" in joined[2] and "distributed_optimizer" in joined[2]
    assert "fleet.main_program" in joined[3] and "fleet.startup_program" in joined[3]
    assert "save_persistables" in joined[4] and "fleet.worker_index() == 0" in joined[4]


def test_checker_rejects_an_unmarked_change():
    old = ["a = 1", "", "b = 2"]
    new = ["a = 1", "", "b = 3"]
    assert changed_blocks(old, new)[0][0] == 0
