"""How far a newcomer walks to follow the trainer, measured on the running code by
tools/walk.py: one `minigpt train` step to `optimizer.step()` crosses at most 8 minigpt files
(nanoGPT: 2; data/rows.py is where the step reads its rows, the data's design living with the
data; core/kernels.py holds the hand-written CPU ops the model calls, kept out of core/gpt.py so
that the model reads in one sitting), the loop module stays short with few imports, and set-up
visits each of its parts once, never climbing back to a module it left."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from conftest import tiny_train_sets

MAX_FILES_PER_STEP = 8
MAX_LOOP_LINES = 250
MAX_LOOP_IMPORTS = 10  # distinct minigpt modules


def walk_tool():
    """tools/walk.py as a module."""
    if "walk_tool" not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "tools" / "walk.py"
        spec = importlib.util.spec_from_file_location("walk_tool", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["walk_tool"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["walk_tool"]


@pytest.fixture(scope="module")
def walks(tmp_path_factory) -> dict[str, dict]:
    """The walk of a corpus run (`--config bytes` on a small corpus) and of a synthetic
    induction run, one short `minigpt train` each, in this process."""
    tmp = tmp_path_factory.mktemp("walk")
    corpus = [s for s in tiny_train_sets(tmp) if s.startswith("data.")]
    return {"bytes": walk_tool().measure("bytes", corpus),
            "induction": walk_tool().measure("induction", ["train.stop_when_formed=[]"])}


@pytest.mark.parametrize("config", ["bytes", "induction"])
def test_one_training_step_crosses_at_most_eight_files(walks, config):
    w = walks[config]
    # the measure sees the walk: the command, the loop, core's step and the model
    assert {"cli/train.py", "train/loop.py", "core/step.py", "core/gpt.py"} <= set(w["files"])
    assert w["stack"][0] == "cli/train.py"
    assert w["files_per_step"] <= MAX_FILES_PER_STEP, w["files"]


def test_the_loop_module_is_short_and_imports_little():
    loop = walk_tool().loop_module()
    assert loop["lines"] <= MAX_LOOP_LINES, loop
    assert loop["imports"] <= MAX_LOOP_IMPORTS, loop["modules"]


@pytest.mark.parametrize("config", ["bytes", "induction"])
def test_set_up_never_climbs_back_to_a_module_it_left(walks, config):
    rooms = walks[config]["set_up"]["rooms"]
    assert len(rooms) >= 4, rooms  # the parts set_up puts together
    assert walk_tool().climbs_back(rooms) == [], rooms


def test_the_measures_catch_what_they_look_for(tmp_path):
    tool = walk_tool()
    assert tool.climbs_back(["a", "b", "c"]) == []
    assert tool.climbs_back(["a", "b", "a", "c", "b"]) == ["a", "b"]
    src = tmp_path / "loop.py"
    src.write_text("from __future__ import annotations\nimport math\nfrom minigpt.events "
                   "import A, B\nimport minigpt.core.gpt\ndef f():\n    from minigpt.events "
                   "import C\n")
    got = tool.loop_module(src)
    assert got["lines"] == 6 and got["imports"] == 2 and got["imports_all"] == 3
