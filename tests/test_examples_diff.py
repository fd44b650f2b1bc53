"""The quick-start conversion is exactly seed 003's four steps: every change sits in a marked step."""

from __future__ import annotations

import ast
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


# --------------------------------------------------------------------------- pytorch_mnist

MNIST = EXAMPLES.parent / "pytorch_mnist"

#: the documented conversion of main.py into main_fleet.py (its docstring lists the same steps)
MNIST_REMOVED = [
    'device = torch.device("cuda" if use_cuda else "cpu")',
    "train_loader = torch.utils.data.DataLoader(dataset1, **train_kwargs)",   # 3. read through fleetlike.io
    "if args.save_model:",
]
MNIST_ADDED = [
    "from fleetlike import fleet, io",                                        # 1. import
    "fleet.init()",                                                           # 2. init, device
    "device = fleet.device()",
    # 3. this worker's shard of the training set, prefetched, resumable
    "train_loader = io.get_data_loader(dataset1, **train_kwargs)",
    "model = fleet.distributed_model(model)",                                 # 4. the model
    "optimizer = fleet.distributed_optimizer(optimizer)",                     # 5. the optimizer
    "train_loader.set_epoch(epoch)",                                          # 3. reshuffled each epoch
    "if args.save_model and fleet.worker_index() == 0:",                      # 6. save on rank 0
]


def code_lines(path: Path) -> list[str]:
    """The script's lines after its module docstring (the two docstrings differ by design)."""
    text = path.read_text()
    tree = ast.parse(text)
    first = tree.body[0]
    start = first.end_lineno if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else 0
    return text.splitlines()[start:]


def test_mnist_conversion_is_the_documented_lines_and_nothing_else():
    old, new = code_lines(MNIST / "main.py"), code_lines(MNIST / "main_fleet.py")
    shown = "\n".join(difflib.unified_diff(old, new, "main.py", "main_fleet.py", n=0, lineterm=""))
    print(shown)  # pytest -s shows the conversion
    removed = [line[1:].strip() for line in shown.splitlines()[2:] if line.startswith("-")]
    added = [line[1:].strip() for line in shown.splitlines()[2:] if line.startswith("+") and line[1:].strip()]
    assert removed == MNIST_REMOVED, shown
    assert added == MNIST_ADDED, shown


def test_mnist_original_keeps_pytorch_examples_structure():
    """main.py is pytorch/examples' mnist/main.py: the same Net, functions, flags and optimizer."""
    text = (MNIST / "main.py").read_text()
    tree = ast.parse(text)
    funcs = {n.name: [a.arg for a in n.args.args] for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert funcs["train"] == ["args", "model", "device", "train_loader", "optimizer", "epoch"]
    assert funcs["test"] == ["model", "device", "test_loader"]
    assert "main" in funcs
    net = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Net")
    layers = re.findall(r"self\.(\w+) = nn\.", ast.get_source_segment(text, net) or "")
    assert layers == ["conv1", "conv2", "dropout1", "dropout2", "fc1", "fc2"]
    flags = re.findall(r"add_argument\('(--[\w-]+)'", text)
    for flag in ("--batch-size", "--test-batch-size", "--epochs", "--lr", "--gamma", "--no-cuda",
                 "--dry-run", "--seed", "--log-interval", "--save-model"):
        assert flag in flags
    assert "optim.Adadelta(model.parameters(), lr=args.lr)" in text
    assert "StepLR(optimizer, step_size=1, gamma=args.gamma)" in text
    assert "torchvision" not in text  # synthetic data: nothing to download
